//! The agent's wire protocol against PKO v2.9.0's: every field and RPC PKO's agent has, ours
//! has with the same number, label and type, and our additions take numbers PKO does not use,
//! so PKO's operator can drive our agent and ours PKO's. PKO's facts are a fixture
//! (`tests/fixtures/pko-v2.9-agent-wire.txt`) re-derived here from PKO's source tarball when it
//! is on the machine.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::PathBuf;

use pko_tests::proto::wire_facts;

const OURS: &str = include_str!("../../../agent/api/proto/agent.proto");
const PKO_FIXTURE: &str = include_str!("../../fixtures/pko-v2.9-agent-wire.txt");

fn pko_facts() -> Vec<String> {
    PKO_FIXTURE
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `field M.name N …` → (M, N, the whole fact).
fn numbered(facts: &[String]) -> Vec<(String, u32, String)> {
    facts
        .iter()
        .filter_map(|f| {
            let mut words = f.split_whitespace();
            (words.next()? == "field").then_some(())?;
            let (message, _) = words.next()?.split_once('.')?;
            let number = words.next()?.parse().ok()?;
            Some((message.to_owned(), number, f.clone()))
        })
        .collect()
}

#[test]
fn every_field_and_rpc_of_pkos_agent_is_ours_with_the_same_number() {
    let ours: BTreeSet<String> = wire_facts(OURS).into_iter().collect();
    let pko = pko_facts();
    assert!(pko.len() > 100, "the fixture holds PKO's protocol");
    let missing: Vec<&String> = pko.iter().filter(|f| !ours.contains(*f)).collect();
    assert!(missing.is_empty(), "PKO's, not ours: {missing:#?}");
    // Ours in PKO's messages: no number PKO gives another field.
    let pko_numbers: BTreeMap<(String, u32), String> = numbered(&pko)
        .into_iter()
        .map(|(m, n, f)| ((m, n), f))
        .collect();
    let ours: Vec<String> = ours.into_iter().collect();
    for (message, number, fact) in numbered(&ours) {
        if let Some(theirs) = pko_numbers.get(&(message, number)) {
            assert_eq!(&fact, theirs, "one field number, two meanings");
        }
    }
}

#[test]
fn a_refresh_that_runs_the_program_is_field_5_as_in_pkos_agent() {
    use prost::Message;
    let request = pko_agent::proto::RefreshRequest {
        run_program: Some(true),
        ..Default::default()
    };
    // Field 5, varint, true: what PKO's operator sends for `refresh --run-program`.
    assert_eq!(request.encode_to_vec(), [5 << 3, 1]);
    let preview = pko_agent::proto::RefreshRequest {
        preview_only: Some(true),
        ..Default::default()
    };
    assert_eq!(preview.encode_to_vec(), [6 << 3, 1]);
}

/// PKO's source tarball: `$PKO_SRC_TARBALL`, else where `tools/build.sh` looks for it.
fn pko_tarball() -> PathBuf {
    #[allow(
        clippy::disallowed_methods,
        reason = "a test process is configured by its environment (make sets the paths)"
    )]
    let set = std::env::var_os("PKO_SRC_TARBALL").filter(|v| !v.is_empty());
    set.map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/reference/pko-v2.9.0-src.tar.gz")
    })
}

#[test]
fn the_fixture_is_what_pkos_source_says() {
    let path = pko_tarball();
    let Ok(file) = std::fs::File::open(&path) else {
        // The fixture is then checked against our protocol only (the test above).
        println!(
            "{} not found: the fixture is not re-derived",
            path.display()
        );
        return;
    };
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut proto = None;
    for entry in archive.entries().expect("tar entries") {
        let mut entry = entry.expect("tar entry");
        let name = entry.path().expect("entry path").display().to_string();
        if name.ends_with("agent/pkg/proto/agent.proto") {
            let mut text = String::new();
            entry.read_to_string(&mut text).expect("read proto");
            proto = Some(text);
            break;
        }
    }
    let proto = proto.expect("agent/pkg/proto/agent.proto in PKO's source");
    assert_eq!(wire_facts(&proto), pko_facts());
}
