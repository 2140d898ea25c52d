//! A Program's chain: the transforms that select it (by namespace and labels), in order.

use super::*;

/// The transforms selecting a Program, in chain order.
pub(super) fn matching<'a>(
    state: &'a State,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<(&'a TransformKey, &'a Entry)> {
    let default_labels;
    let namespace_labels = match state.namespaces.get(namespace) {
        Some(labels) => labels,
        None => {
            // The apiserver sets this label on every namespace; assume it before the watch
            // has seen the namespace.
            default_labels = BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                namespace.to_owned(),
            )]);
            &default_labels
        }
    };
    let mut selected: Vec<(&TransformKey, &Entry)> = state
        .entries
        .iter()
        .filter(|(key, entry)| entry.selects(key, namespace, namespace_labels, labels))
        .collect();
    selected.sort_by(|(ka, a), (kb, b)| {
        (a.priority, &ka.name, ka.kind, &ka.namespace).cmp(&(
            b.priority,
            &kb.name,
            kb.kind,
            &kb.namespace,
        ))
    });
    selected
}

/// The chain of a Program from the current states (a module still loading fails its step
/// with a transient error).
pub(super) fn resolve(state: &State, namespace: &str, labels: &BTreeMap<String, String>) -> Chain {
    let steps = matching(state, namespace, labels)
        .into_iter()
        .map(|(key, entry)| {
            let state = entry.state.borrow();
            let (module, config, limits) = match &*state {
                LoadState::Ready(module) => (
                    Ok(module.clone()),
                    entry.load.config.clone(),
                    entry.load.limits,
                ),
                LoadState::Previous { previous, .. } => (
                    Ok(previous.module.clone()),
                    previous.config.clone(),
                    previous.limits,
                ),
                LoadState::Failed(err) => (
                    Err(err.clone()),
                    entry.load.config.clone(),
                    entry.load.limits,
                ),
                LoadState::Loading => (
                    Err(PluginError::Source("the module is still loading".into())),
                    entry.load.config.clone(),
                    entry.load.limits,
                ),
            };
            Step {
                id: key.to_string(),
                priority: entry.priority,
                policy: entry.policy,
                module,
                config,
                limits,
            }
        })
        .collect();
    Chain { steps }
}

pub(super) fn selectors(
    view: &TransformView<'_>,
) -> (Option<Selector>, Option<Selector>, Option<String>) {
    let parse = |s: Option<&LabelSelector>, what: &str| -> Result<Option<Selector>, String> {
        s.cloned()
            .map(Selector::try_from)
            .transpose()
            .map_err(|e| format!("{what}: {e}"))
    };
    match (
        parse(view.namespace_selector, "namespaceSelector"),
        parse(view.program_selector, "programSelector"),
    ) {
        (Ok(ns), Ok(program)) => (ns, program, None),
        (Err(e), _) | (_, Err(e)) => (None, None, Some(e)),
    }
}

pub(super) fn overrides(view: &TransformView<'_>) -> LimitOverrides {
    let positive = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok()).filter(|v| *v > 0);
    match view.common.limits {
        Some(limits) => LimitOverrides {
            fuel: positive(limits.fuel),
            timeout: positive(limits.timeout_millis).map(Duration::from_millis),
            memory_bytes: positive(limits.memory_mib).map(|m| m << 20),
            output_bytes: positive(limits.output_kib).map(|k| k << 10),
        },
        None => LimitOverrides::default(),
    }
}
