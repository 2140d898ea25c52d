//! The Update a stack creates for one operation: typed, then the Stack's `updateTemplate`
//! strategically merged on, its metadata's labels and annotations included (as PKO patches the
//! whole Update). The stack's own labels always win: the controller finds its Updates by
//! them. The name, namespace and owners are the controller's.

use kube::{Resource, ResourceExt};
use pko_api::stack::Stack;
use pko_api::update::{Update, UpdateSpec, UpdateType};
use pko_api::workspace::Workspace;

use super::outcome::StackError;
use super::workspace::{labels, strip_nulls};
use crate::controller::kit;
use crate::controller::workspace::merge;

/// Completed Updates are deleted after this long.
const TTL_AFTER_COMPLETED: &str = "24h";

/// What an Update is made of.
pub(super) struct Request<'a> {
    pub stack: &'a Stack,
    /// The stack's Workspace, as applied (its uid owns the Update).
    pub workspace: &'a Workspace,
    pub name: String,
    pub type_: UpdateType,
    /// Why it runs (the Update's message).
    pub why: &'a str,
    /// A drift check: a refresh that changes no state (`previewOnly`), whatever the template
    /// says.
    pub check: bool,
}

/// The Update's spec: a destroy may run the program; other operations take the stack's
/// targets and refresh setting.
fn spec(stack: &Stack, workspace: &str, type_: UpdateType, why: &str) -> UpdateSpec {
    let mut spec = UpdateSpec {
        workspace_name: Some(workspace.to_owned()),
        stack_name: Some(stack.spec.stack.clone()),
        type_: Some(type_),
        ttl_after_completed: Some(TTL_AFTER_COMPLETED.into()),
        message: Some(why.to_owned()),
        ..Default::default()
    };
    if type_ == UpdateType::Destroy {
        spec.run_program = stack.spec.run_program;
    } else {
        spec.target = stack.spec.targets.clone();
        spec.target_dependents = stack.spec.target_dependents;
        spec.refresh = stack.spec.refresh;
    }
    spec
}

/// The Update, controlled by the Workspace and also owned by the Stack (so deleting either
/// collects it).
pub(super) fn object(request: &Request<'_>) -> Result<Update, StackError> {
    let Request {
        stack,
        workspace,
        name,
        type_,
        why,
        check,
    } = request;
    let stack_name = stack.name_any();
    let by_workspace =
        kit::controller_owner(*workspace).ok_or(StackError::NoUid("the Workspace"))?;
    let mut by_stack = stack.owner_ref(&()).ok_or(StackError::NoUid("the Stack"))?;
    by_stack.block_owner_deletion = Some(true);
    let mut spec = spec(stack, &stack_name, *type_, why);
    if *check {
        spec.refresh = None;
        spec.preview_only = Some(true);
    }
    let mut update = Update::new(name, spec);
    update.metadata.namespace = stack.namespace();
    update.metadata.labels = Some(labels(&stack_name));
    update.metadata.owner_references = Some(vec![by_workspace, by_stack]);
    let template = stack.spec.update_template.as_ref();
    if let Some(meta) = template.and_then(|t| t.metadata.as_ref()) {
        if !meta.labels.is_empty() {
            let mut l = meta.labels.clone();
            l.extend(labels(&stack_name));
            update.metadata.labels = Some(l);
        }
        if !meta.annotations.is_empty() {
            update.metadata.annotations = Some(meta.annotations.clone());
        }
    }
    let Some(template) = template.and_then(|t| t.spec.as_ref()) else {
        return Ok(update);
    };
    let mut update = serde_json::to_value(&update)?;
    merge::merge(&mut update["spec"], &serde_json::to_value(template)?);
    strip_nulls(&mut update);
    let mut update: Update = serde_json::from_value(update)?;
    if *check {
        // A template can tune a check (parallel, timeout), never make it write the state.
        update.spec.type_ = Some(UpdateType::Refresh);
        update.spec.preview_only = Some(true);
    }
    Ok(update)
}

#[cfg(test)]
mod tests {
    use pko_api::workspace::WorkspaceSpec;
    use serde_json::json;

    use super::*;
    use crate::controller::keys::{STACK_COMPONENT_LABEL, STACK_NAME_LABEL};

    fn stack(spec: serde_json::Value) -> Stack {
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns", "uid": "stack-uid"},
            "spec": spec,
        }))
        .expect("stack")
    }

    fn workspace() -> Workspace {
        let mut ws = Workspace::new("s", WorkspaceSpec::default());
        ws.metadata.namespace = Some("ns".into());
        ws.metadata.uid = Some("ws-uid".into());
        ws
    }

    #[test]
    fn updates_are_owned_by_workspace_and_stack() {
        let s = stack(
            json!({"stack": "dev", "targets": ["urn:a"], "refresh": true, "runProgram": true}),
        );
        let ws = workspace();
        let update = object(&Request {
            stack: &s,
            workspace: &ws,
            name: "s-1".into(),
            type_: UpdateType::Up,
            why: "Initial stack update",
            check: false,
        })
        .expect("update");
        let v = serde_json::to_value(&update).expect("json");
        assert_eq!(
            v,
            json!({
                "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
                "metadata": {
                    "name": "s-1", "namespace": "ns",
                    "labels": {STACK_COMPONENT_LABEL: "stack", STACK_NAME_LABEL: "s"},
                    "ownerReferences": [
                        {"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace", "name": "s", "uid": "ws-uid", "controller": true, "blockOwnerDeletion": true},
                        {"apiVersion": "pulumi.com/v1", "kind": "Stack", "name": "s", "uid": "stack-uid", "blockOwnerDeletion": true},
                    ],
                },
                "spec": {
                    "workspaceName": "s", "stackName": "dev", "type": "up", "ttlAfterCompleted": "24h",
                    "message": "Initial stack update", "target": ["urn:a"], "refresh": true,
                },
            })
        );
        let destroy = object(&Request {
            stack: &s,
            workspace: &ws,
            name: "s-2".into(),
            type_: UpdateType::Destroy,
            why: "Stack marked for deletion",
            check: false,
        })
        .expect("update");
        assert_eq!(destroy.spec.run_program, Some(true));
        assert!(destroy.spec.target.is_empty() && destroy.spec.refresh.is_none());
    }

    #[test]
    fn the_template_is_merged_onto_the_spec() {
        let s = stack(json!({"stack": "dev", "targets": ["urn:a"],
            "updateTemplate": {"spec": {"parallel": 2, "target": ["urn:b"], "ttlAfterCompleted": "1h",
                "operationTimeout": "30m"}}}));
        let ws = workspace();
        let update = object(&Request {
            stack: &s,
            workspace: &ws,
            name: "s-1".into(),
            type_: UpdateType::Preview,
            why: "why",
            check: false,
        })
        .expect("update");
        assert_eq!(update.spec.parallel, Some(2));
        assert_eq!(update.spec.target, vec!["urn:b".to_owned()]);
        assert_eq!(update.spec.ttl_after_completed.as_deref(), Some("1h"));
        // The Stack's operation timeout travels through its template.
        assert_eq!(update.spec.operation_timeout.as_deref(), Some("30m"));
        assert_eq!(update.spec.type_, Some(UpdateType::Preview));
        assert_eq!(update.metadata.owner_references.map(|o| o.len()), Some(2));
    }

    #[test]
    fn a_drift_check_is_a_preview_only_refresh_whatever_the_template_says() {
        let s = stack(
            json!({"stack": "dev", "refresh": true, "targets": ["urn:a"],
            "updateTemplate": {"spec": {"parallel": 2, "previewOnly": false, "type": "up"}}}),
        );
        let ws = workspace();
        let update = object(&Request {
            stack: &s,
            workspace: &ws,
            name: "s-1".into(),
            type_: UpdateType::Refresh,
            why: "drift check",
            check: true,
        })
        .expect("update");
        assert_eq!(update.spec.type_, Some(UpdateType::Refresh));
        assert_eq!(update.spec.preview_only, Some(true));
        assert_eq!(update.spec.parallel, Some(2));
        assert_eq!(update.spec.target, vec!["urn:a".to_owned()]);
        assert_eq!(update.spec.refresh, None);
    }

    #[test]
    fn the_template_metadata_labels_and_annotates_the_update() {
        let s = stack(json!({"stack": "dev", "updateTemplate": {
            "metadata": {"name": "hijack", "labels": {"team": "a", STACK_NAME_LABEL: "other"},
                "annotations": {"note": "x"}},
        }}));
        let ws = workspace();
        let update = object(&Request {
            stack: &s,
            workspace: &ws,
            name: "s-1".into(),
            type_: UpdateType::Up,
            why: "why",
            check: false,
        })
        .expect("update");
        assert_eq!(update.metadata.name.as_deref(), Some("s-1"));
        let labels = update.metadata.labels.expect("labels");
        assert_eq!(labels.get("team").map(String::as_str), Some("a"));
        assert_eq!(labels.get(STACK_NAME_LABEL).map(String::as_str), Some("s"));
        assert_eq!(
            labels.get(STACK_COMPONENT_LABEL).map(String::as_str),
            Some("stack")
        );
        let annotations = update.metadata.annotations.expect("annotations");
        assert_eq!(annotations.get("note").map(String::as_str), Some("x"));
    }
}
