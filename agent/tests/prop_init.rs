//! Property tests of `init`'s unpacking of hostile archives: whatever the tar.gz holds
//! (`..`, absolute names, links out, link chains, devices, duplicate and conflicting names,
//! sizes that lie), `unpack_into` returns, leaves everything outside its target folder as it
//! was, keeps the old folder on failure, and on success leaves only files, folders and links
//! that stay inside, within the size limit.
//!
//! Case count: PKO_PROPTEST_CASES (default below; `make fuzz-long` raises it). Failures are not
//! persisted: proptest prints the shrunk archive, which becomes a unit test in init.rs.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use pko_agent::init::unpack_into;
use proptest::prelude::*;

fn config(default_cases: u32) -> ProptestConfig {
    let cases = match std::env::var("PKO_PROPTEST_CASES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("PKO_PROPTEST_CASES={v:?}: expected a case count")),
        Err(_) => default_cases,
    };
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[derive(Clone, Debug)]
enum Entry {
    File {
        name: String,
        data: Vec<u8>,
    },
    Dir {
        name: String,
    },
    Symlink {
        name: String,
        target: String,
    },
    HardLink {
        name: String,
        target: String,
    },
    Fifo {
        name: String,
    },
    /// A regular file whose header claims more data than follows.
    Lying {
        name: String,
        claimed: u64,
    },
}

/// Names built from parts that matter to a path: `..`, `.`, empty parts, a leading `/`.
fn name() -> impl Strategy<Value = String> {
    // Mostly ordinary parts, so that many archives unpack and their links get checked.
    let part = prop::sample::select(vec![
        "a", "a", "b", "b", "c", "c", "..", ".", "", "d d", "é",
    ]);
    (prop::bool::weighted(0.1), prop::collection::vec(part, 1..4)).prop_map(|(absolute, parts)| {
        let joined = parts.join("/");
        if absolute {
            format!("/{joined}")
        } else {
            joined
        }
    })
}

fn entry() -> impl Strategy<Value = Entry> {
    // Kinds that always fail are rarer, so that longer archives get through too.
    prop_oneof![
        8 => (name(), prop::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(name, data)| Entry::File { name, data }),
        4 => name().prop_map(|name| Entry::Dir { name }),
        6 => (name(), name()).prop_map(|(name, target)| Entry::Symlink { name, target }),
        2 => (name(), name()).prop_map(|(name, target)| Entry::HardLink { name, target }),
        1 => name().prop_map(|name| Entry::Fifo { name }),
        1 => (name(), prop::sample::select(vec![513u64, 1 << 20, 1 << 33]))
            .prop_map(|(name, claimed)| Entry::Lying { name, claimed }),
    ]
}

/// The archive with every name written byte for byte (tar::Builder would refuse `..`).
fn targz(entries: &[Entry]) -> Vec<u8> {
    let mut tar = Vec::new();
    for entry in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o6777);
        let (name, kind, data, link): (&str, _, &[u8], &str) = match entry {
            Entry::File { name, data } => (name, tar::EntryType::Regular, data, ""),
            Entry::Dir { name } => (name, tar::EntryType::Directory, &[], ""),
            Entry::Symlink { name, target } => (name, tar::EntryType::Symlink, &[], target),
            Entry::HardLink { name, target } => (name, tar::EntryType::Link, &[], target),
            Entry::Fifo { name } => (name, tar::EntryType::Fifo, &[], ""),
            Entry::Lying { name, .. } => (name, tar::EntryType::Regular, b"short", ""),
        };
        h.set_entry_type(kind);
        h.set_size(match entry {
            Entry::Lying { claimed, .. } => *claimed,
            _ => data.len() as u64,
        });
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_cksum();
        tar.extend_from_slice(h.as_bytes());
        tar.extend_from_slice(data);
        tar.resize(tar.len().div_ceil(512) * 512, 0);
    }
    tar.resize(tar.len() + 1024, 0);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar).expect("gzip");
    gz.finish().expect("gzip")
}

/// Everything under `root` (links not followed), except `skip`: kind, mode and content.
fn snapshot(root: &Path, skip: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for item in std::fs::read_dir(&dir).expect("read_dir") {
            let path = item.expect("entry").path();
            if path == skip {
                continue;
            }
            let meta = path.symlink_metadata().expect("metadata");
            let what = if meta.is_dir() {
                stack.push(path.clone());
                "dir".to_owned()
            } else if meta.file_type().is_symlink() {
                format!("link {:?}", std::fs::read_link(&path).expect("link"))
            } else {
                format!(
                    "file {:o} {:?}",
                    meta.mode(),
                    std::fs::read(&path).expect("read")
                )
            };
            out.insert(path, what);
        }
    }
    out
}

struct World {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    target: PathBuf,
}

/// A folder with things around the target that an escape would touch.
fn world(existing_target: bool) -> World {
    let tmp = tempfile::tempdir().expect("tmp");
    let root = tmp.path().canonicalize().expect("canonical");
    let work = root.join("w");
    std::fs::create_dir_all(root.join("outside")).expect("outside");
    std::fs::write(root.join("outside/secret"), b"secret").expect("secret");
    std::fs::create_dir_all(&work).expect("work");
    std::fs::write(work.join("a"), b"sibling").expect("sibling");
    let target = work.join("source");
    if existing_target {
        std::fs::create_dir_all(target.join("old")).expect("old");
        std::fs::write(target.join("old/file"), b"old").expect("old file");
    }
    World {
        _tmp: tmp,
        root,
        target,
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn hostile_archives_stay_inside(
        entries in prop::collection::vec(entry(), 0..10),
        limit in prop::sample::select(vec![64u64, 4096, 1 << 20]),
        existing in any::<bool>(),
    ) {
        let w = world(existing);
        let around = snapshot(&w.root, &w.target);
        let before = w.target.exists().then(|| snapshot(&w.target, Path::new("")));
        let result = unpack_into(&targz(&entries), &w.target, Some(limit));
        prop_assert_eq!(&snapshot(&w.root, &w.target), &around, "outside changed: {:?}", result);
        match result {
            Err(_) => {
                let after = w.target.exists().then(|| snapshot(&w.target, Path::new("")));
                prop_assert_eq!(after, before, "a failed unpack changed the folder");
            }
            Ok(()) => {
                let inside = snapshot(&w.target, Path::new(""));
                let mut inodes = HashSet::new();
                let mut bytes = 0;
                for (path, what) in &inside {
                    let meta = path.symlink_metadata().expect("metadata");
                    let kind = meta.file_type();
                    prop_assert!(kind.is_dir() || kind.is_file() || kind.is_symlink(), "{what}");
                    if kind.is_file() {
                        prop_assert_eq!(meta.mode() & 0o7022, 0, "{}", what);
                        if inodes.insert(meta.ino()) {
                            bytes += meta.len();
                        }
                    }
                    if kind.is_symlink() {
                        match path.canonicalize() {
                            Ok(resolved) => prop_assert!(
                                resolved.starts_with(&w.target),
                                "{} -> {}", path.display(), resolved.display()
                            ),
                            // Dangling: what the program writes through it lands inside too.
                            Err(_) => {
                                let _ = std::fs::write(path, b"x");
                            }
                        }
                    }
                }
                prop_assert!(bytes <= limit, "{bytes} bytes written, limit {limit}");
                prop_assert_eq!(&snapshot(&w.root, &w.target), &around, "escaped through a link");
            }
        }
    }

    /// Ordinary archives (distinct plain names, files only at leaves) unpack to exactly what
    /// they hold.
    #[test]
    fn plain_archives_unpack_exactly(
        files in prop::collection::btree_map("[a-z]{1,3}(/[a-z]{1,3}){0,2}", prop::collection::vec(any::<u8>(), 0..200), 0..10),
    ) {
        // A name that is also a folder of another is not a plain archive.
        let names: Vec<&String> = files.keys().collect();
        let plain: BTreeMap<&String, &Vec<u8>> = files
            .iter()
            .filter(|(n, _)| !names.iter().any(|o| o.starts_with(&format!("{n}/"))))
            .collect();
        let entries: Vec<Entry> = plain
            .iter()
            .map(|(name, data)| Entry::File { name: name.to_string(), data: data.to_vec() })
            .collect();
        let w = world(true);
        unpack_into(&targz(&entries), &w.target, None).expect("plain archive");
        let files_inside: BTreeMap<String, Vec<u8>> = snapshot(&w.target, Path::new(""))
            .into_keys()
            .filter(|p| p.is_file())
            .map(|p| {
                let rel = p.strip_prefix(&w.target).expect("inside").to_string_lossy().into_owned();
                let data = std::fs::read(&p).expect("read");
                (rel, data)
            })
            .collect();
        let expected: BTreeMap<String, Vec<u8>> =
            plain.into_iter().map(|(n, d)| (n.clone(), d.clone())).collect();
        prop_assert_eq!(files_inside, expected);
    }
}
