//! `deploy/crds/` holds exactly what `crdgen::render_all()` produces.

use crate::crdgen::{HEADER, render_all, write_all};

use super::support::deploy_crds_dir;

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "PKO_UPDATE_CRDS=1 is how a person asks this test to rewrite the files"
)]
fn deploy_crds_are_up_to_date() {
    let dir = deploy_crds_dir();
    if std::env::var_os("PKO_UPDATE_CRDS").is_some() {
        write_all(&dir).expect("write deploy/crds");
    }
    let rendered = render_all().expect("render CRDs");
    let mut stale = Vec::new();
    for (file, yaml) in &rendered {
        match std::fs::read_to_string(dir.join(file)) {
            Ok(on_disk) if &on_disk == yaml => {}
            Ok(_) => stale.push(format!("{file} differs")),
            Err(e) => stale.push(format!("{file}: {e}")),
        }
    }
    // A generated file for a kind that no longer exists is stale too.
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let generated = std::fs::read_to_string(entry.path())
            .map(|text| text.starts_with(HEADER))
            .unwrap_or(false);
        if generated && !rendered.iter().any(|(file, _)| *file == name) {
            stale.push(format!("{name} is no longer generated"));
        }
    }
    assert!(
        stale.is_empty(),
        "deploy/crds is stale ({}); run `make crds` (or `PKO_UPDATE_CRDS=1 cargo test -p pko-api \
         deploy_crds_are_up_to_date`) to regenerate it",
        stale.join("; ")
    );
}

#[test]
fn rendering_is_deterministic() {
    let first = render_all().expect("render CRDs");
    let second = render_all().expect("render CRDs");
    assert_eq!(first, second);
    for (file, yaml) in &first {
        assert!(
            yaml.starts_with(&format!("{HEADER}\n---\n")),
            "{file} lacks the generated-file header"
        );
    }
}
