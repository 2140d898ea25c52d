package pko.lib_test

import data.pko.lib

review(operation, object, old_object) := {"request": {
	"uid": "1",
	"operation": operation,
	"namespace": "team-a",
	"kind": {"group": "pko-rs.dev", "version": "v1alpha1", "kind": "ProgramTransform"},
	"object": object,
	"oldObject": old_object,
}}

spec := {"sha256": "abcdef", "source": {"configMap": {"name": "m", "key": "k"}}}

live(s) := {"metadata": {"name": "t", "finalizers": ["team-a.example/hold"]}, "spec": s}

deleting(s) := {"metadata": {"name": "t", "deletionTimestamp": "2025-01-01T00:00:00Z"}, "spec": s}

checked(review_doc) if lib.checked with input as review_doc

test_creates_and_updates_are_checked if {
	checked(review("CREATE", live(spec), null))
	checked(review("UPDATE", live(object.union(spec, {"sha256": "123456"})), live(spec)))
	checked(review("UPDATE", live(spec), live(spec)))
}

test_deletes_and_other_operations_are_not_checked if {
	not checked(review("DELETE", null, live(spec)))
	not checked(review("CONNECT", null, null))
}

# Removing finalizers from an object being deleted is let through, whatever its spec.
test_finalizer_removal_is_not_checked if {
	not checked(review("UPDATE", deleting(spec), live(spec)))
	not checked(review("UPDATE", deleting(spec), deleting(spec)))
	not checked(review("UPDATE", deleting({"sha256": "not allowed"}), live({"sha256": "not allowed"})))
}

# A spec that changes while the object is being deleted is checked.
test_spec_changes_while_being_deleted_are_checked if {
	checked(review("UPDATE", deleting(object.union(spec, {"sha256": "123456"})), live(spec)))
	checked(review("UPDATE", deleting(object.union(spec, {"source": {"url": "https://evil.example/t.wasm"}})), live(spec)))
	checked(review("UPDATE", deleting(object.remove(spec, ["source"])), live(spec)))
	checked(review("UPDATE", deleting(spec), live({})))
}

# Without an old object (or an old spec) there is nothing to compare with: checked.
test_deletions_without_an_old_spec_are_checked if {
	checked(review("UPDATE", deleting(spec), null))
	checked(review("UPDATE", deleting(spec), {"metadata": {"name": "t"}}))
	checked(review("CREATE", deleting(spec), null))
}
