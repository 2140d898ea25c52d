# METADATA
# title: Admission decision (entrypoint pko/admission/decision)
# description: |
#   Collects the violations of every policy and gives each its enforcement action:
#   - a violation made by a TenancyPolicy's allowance list gets that policy's action;
#   - any other violation gets the strictest action of the TenancyPolicies selecting the
#     namespace, or data.tenancy.defaultAction ("deny" when unset) if none does.
#   The request is allowed when no violation has the action "deny".
package pko.admission

import data.pko.lib

rank := {"dryrun": 0, "warn": 1, "deny": 2}

default_action := data.tenancy.defaultAction

default_action := "deny" if not data.tenancy.defaultAction

namespace_action := action if {
	count(lib.tenancy_policies) > 0
	strictest := max({rank[p.action] | some p in lib.tenancy_policies})
	some action, r in rank
	r == strictest
}

namespace_action := default_action if count(lib.tenancy_policies) == 0

action_of(v) := p.action if {
	some p in lib.tenancy_policies
	p.name == v.tenancyPolicy
} else := namespace_action

violations contains object.union(v, {"action": action_of(v)}) if {
	some v in data.pko.restricted.violations
}

violations contains object.union(v, {"action": action_of(v)}) if {
	some v in data.pko.isolation.violations
}

# Violations are a sorted array, so every evaluator (and every message) lists them in the
# same order.
decision := {
	"allowed": count({v | some v in violations; v.action == "deny"}) == 0,
	"violations": sort(violations),
}
