//! The plugin host against real components built from plugins/ (`make plugins`): the three
//! plugins, the template, and every hostile guest.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pko_api::program::ProgramSpec;
use pko_plugin_host::chain::{self, Chain, FailurePolicy, Step};
use pko_plugin_host::{
    CallSite, ErrorKind, HostConfig, Limits, LoadSource, Module, PluginError, PluginHost,
    PluginMetrics, ProgramInput, conformance,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Where `make plugins` puts the components: `$PKO_PLUGINS_DIR`, else its default.
fn plugins_dir() -> PathBuf {
    match std::env::var_os("PKO_PLUGINS_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/pko-rs/plugins-target/wasm32-wasip2/release")
        }
    }
}

fn module_bytes(name: &str) -> Vec<u8> {
    let path = plugins_dir().join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "plugin component {} is missing ({e}): run `make plugins` (or set PKO_PLUGINS_DIR)",
            path.display()
        )
    })
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn host_with(config: HostConfig) -> PluginHost {
    PluginHost::new(config, PluginMetrics::new()).expect("plugin host")
}

/// Precompiled modules shared by the tests (and test runs): debug builds compile slowly.
fn shared_cache() -> PathBuf {
    std::env::temp_dir().join("pko-rs-plugin-cache")
}

fn host() -> PluginHost {
    host_with(HostConfig {
        cache_dir: Some(shared_cache()),
        ..HostConfig::default()
    })
}

async fn load(host: &PluginHost, name: &str) -> Arc<Module> {
    let bytes = module_bytes(name);
    let digest = sha(&bytes);
    host.load(bytes, &digest, &CallSite::new(name))
        .await
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

fn input(spec: Value) -> ProgramInput {
    ProgramInput {
        namespace: "team-a".into(),
        name: "web".into(),
        labels: BTreeMap::from([("team".to_owned(), "blue".to_owned())]),
        spec,
    }
}

fn bucket_program() -> Value {
    json!({"resources": {"bucket": {"type": "aws:s3/bucket:Bucket", "properties": {"name": "logs"}}}})
}

async fn transform(
    host: &PluginHost,
    module: &Arc<Module>,
    config: Value,
    limits: Limits,
) -> Result<pko_plugin_host::host::TransformOutput, PluginError> {
    host.transform(
        module,
        &input(bucket_program()),
        &config,
        limits,
        &CallSite::new("test"),
    )
    .await
}

#[tokio::test]
async fn plugins_load_with_their_info_and_transform() {
    let host = host();
    let tags = load(&host, "default_tags").await;
    assert_eq!(tags.info().name, "default-tags");
    assert_eq!(tags.info().version, "0.1.0");
    assert!(tags.digest().starts_with("sha256:"));
    let config = json!({"tags": {"managed-by": "pko-rs"}, "fromLabels": {"team": "team"}, "targets": [{"typePrefix": "aws:"}]});
    host.validate_config(&tags, &config, Limits::DEFAULT, &CallSite::new("t"))
        .await
        .expect("valid config");
    let out = transform(&host, &tags, config, Limits::DEFAULT)
        .await
        .expect("transform");
    assert_eq!(
        out.spec["resources"]["bucket"]["properties"]["tags"],
        json!({"managed-by": "pko-rs", "team": "blue"})
    );
    assert!(out.fuel > 0);

    let naming = load(&host, "naming_policy").await;
    let out = transform(&host, &naming, json!({"mode": "prefix"}), Limits::DEFAULT)
        .await
        .expect("prefix");
    assert_eq!(
        out.spec["resources"]["bucket"]["properties"]["name"],
        "team-a-logs"
    );

    let allow = load(&host, "resource_allowlist").await;
    let err = transform(
        &host,
        &allow,
        json!({"allow": ["random:*"]}),
        Limits::DEFAULT,
    )
    .await
    .expect_err("rejected");
    assert_eq!(err.kind(), ErrorKind::Rejected);
    assert!(
        err.to_string()
            .contains("\"bucket\" (aws:s3/bucket:Bucket)"),
        "{err}"
    );

    let err = host
        .validate_config(
            &allow,
            &json!({"allow": []}),
            Limits::DEFAULT,
            &CallSite::new("t"),
        )
        .await
        .expect_err("invalid config");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
}

#[tokio::test]
async fn same_bytes_load_once_and_a_wrong_digest_is_refused() {
    let host = host();
    let a = load(&host, "template").await;
    let b = load(&host, "template").await;
    assert!(Arc::ptr_eq(&a, &b), "one module per digest");
    assert!(host.cached(a.digest()).is_some());

    let bytes = module_bytes("template");
    let wrong = "0".repeat(64);
    let err = host
        .load(bytes, &wrong, &CallSite::new("t"))
        .await
        .expect_err("digest mismatch");
    assert_eq!(err.kind(), ErrorKind::DigestMismatch);
    assert!(err.to_string().contains(&wrong), "{err}");
    assert!(err.to_string().contains(a.digest()), "{err}");

    // Known digest, other bytes: still refused (the cache never stands in for the bytes).
    let other = module_bytes("default_tags");
    let err = host
        .load(other, a.digest(), &CallSite::new("t"))
        .await
        .expect_err("other bytes");
    assert_eq!(err.kind(), ErrorKind::DigestMismatch);

    let err = host
        .load(
            b"\0asm\x01\0\0\0".to_vec(),
            &sha(b"\0asm\x01\0\0\0"),
            &CallSite::new("t"),
        )
        .await
        .expect_err("core module");
    assert_eq!(err.kind(), ErrorKind::Compile);
    assert!(err.to_string().contains("not a component"), "{err}");
}

#[tokio::test]
async fn a_forbidden_import_is_refused_at_load() {
    let host = host();
    let bytes = module_bytes("hostile_forbidden_import");
    let err = host
        .load(bytes.clone(), &sha(&bytes), &CallSite::new("t"))
        .await
        .expect_err("forbidden import");
    assert_eq!(err.kind(), ErrorKind::ForbiddenImport);
    let message = err.to_string();
    assert!(message.contains("hostile:secrets/store@0.1.0"), "{message}");
    assert!(
        message.contains("not an interface plugins are granted"),
        "{message}"
    );
    assert!(host.cached(&format!("sha256:{}", sha(&bytes))).is_none());
}

/// The filesystem and the network are linked only to deny: a guest importing them (as every
/// Python and JavaScript runtime does) loads, and a call that uses them fails naming the
/// function it called.
#[tokio::test]
async fn a_denied_interface_loads_and_fails_the_call_that_uses_it() {
    let host = host();
    let reader = load(&host, "hostile_reads_file").await;
    let err = transform(&host, &reader, Value::Null, Limits::DEFAULT)
        .await
        .expect_err("denied");
    assert_eq!(err.kind(), ErrorKind::ForbiddenImport, "{err}");
    let message = err.to_string();
    assert!(
        message.contains("the plugin called wasi:filesystem/"),
        "{message}"
    );
    assert!(message.contains("plugins have no filesystem"), "{message}");
}

/// The Python and JavaScript plugins (componentize-py, componentize-js) load and transform.
#[tokio::test]
async fn python_and_javascript_plugins_load_and_transform() {
    let host = host();
    let python = load(&host, "python_example").await;
    assert_eq!(python.info().name, "python-example");
    let config = json!({"tags": {"managed-by": "pko-rs"}, "fromLabels": {"team": "team"}, "targets": [{"typePrefix": "aws:"}]});
    let out = transform(&host, &python, config, Limits::DEFAULT)
        .await
        .expect("python transform");
    assert_eq!(
        out.spec["resources"]["bucket"]["properties"]["tags"],
        json!({"managed-by": "pko-rs", "team": "blue"})
    );
    let js = load(&host, "js_example").await;
    assert_eq!(js.info().name, "js-example");
    let out = transform(&host, &js, json!({"mode": "prefix"}), Limits::DEFAULT)
        .await
        .expect("js transform");
    assert_eq!(
        out.spec["resources"]["bucket"]["properties"]["name"],
        "team-a-logs"
    );
}

#[tokio::test]
async fn hostile_guests_are_contained_and_named() {
    let host = host();
    // Each limit test trips only its own limit: the wall-clock budget is out of reach here
    // (fuel stops a runaway), so a slow machine cannot turn another failure into a timeout.
    let small = Limits {
        fuel: 50_000_000,
        timeout: Duration::from_secs(3600),
        memory_bytes: 32 << 20,
        output_bytes: 1 << 20,
    };

    let looping = load(&host, "hostile_infinite_loop").await;
    let err = transform(&host, &looping, Value::Null, small)
        .await
        .expect_err("fuel");
    assert_eq!(err, PluginError::FuelExhausted(small.fuel));

    let started = Instant::now();
    let timed = Limits {
        fuel: u64::MAX / 2,
        timeout: Duration::from_millis(300),
        ..small
    };
    let err = transform(&host, &looping, Value::Null, timed)
        .await
        .expect_err("timeout");
    assert_eq!(err, PluginError::Timeout(timed.timeout));
    // Stopped by the deadline, not before it (epoch ticks are 10 ms). No upper bound: the
    // error kind already says the deadline fired, and how soon depends on the machine.
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(290), "timeout took {took:?}");

    let bomb = load(&host, "hostile_memory_bomb").await;
    // Only the memory cap may stop the bomb.
    let hoarding = Limits {
        fuel: u64::MAX / 2,
        ..small
    };
    let err = transform(&host, &bomb, Value::Null, hoarding)
        .await
        .expect_err("memory");
    assert_eq!(err, PluginError::MemoryLimit(hoarding.memory_bytes));

    let trap = load(&host, "hostile_trap").await;
    let err = transform(&host, &trap, Value::Null, small)
        .await
        .expect_err("trap");
    assert_eq!(err.kind(), ErrorKind::Trap);
    assert!(
        err.to_string().contains("deliberate panic for web"),
        "the panic message reaches the error: {err}"
    );

    let invalid = load(&host, "hostile_invalid_json").await;
    let err = transform(&host, &invalid, Value::Null, small)
        .await
        .expect_err("invalid json");
    assert_eq!(err.kind(), ErrorKind::InvalidOutput);
    assert!(err.to_string().contains("not JSON"), "{err}");

    let oversized = load(&host, "hostile_oversized_output").await;
    let roomy = Limits {
        memory_bytes: 128 << 20,
        ..small
    };
    let err = transform(&host, &oversized, Value::Null, roomy)
        .await
        .expect_err("oversized");
    assert!(
        matches!(err, PluginError::OutputTooLarge { limit, size } if limit == 1 << 20 && size > 8 << 20),
        "{err}"
    );

    // The host is unharmed: a well-behaved plugin still works, and slots were all returned.
    let template = load(&host, "template").await;
    for _ in 0..(HostConfig::default().max_concurrent_calls * 2) {
        transform(&host, &template, Value::Null, Limits::DEFAULT)
            .await
            .expect("template still works");
    }
}

/// Every call starts from the module's initial state, also when the host reuses pool slots
/// (memory reset in place) and calls run in parallel: a guest that counts its calls in a
/// global, fills a static buffer and leaks a heap value sees none of it on the next call.
#[tokio::test]
async fn no_state_survives_a_call() {
    let host = host();
    let stateful = load(&host, "hostile_stateful").await;
    let fresh = vec![
        "calls before: 0".to_owned(),
        "dirty buffer bytes: 0".to_owned(),
        "leaked by an earlier call: none".to_owned(),
    ];
    for round in 0..20 {
        host.validate_config(
            &stateful,
            &Value::Null,
            Limits::DEFAULT,
            &CallSite::new("t"),
        )
        .await
        .expect("validate");
        let out = transform(&host, &stateful, Value::Null, Limits::DEFAULT)
            .await
            .expect("transform");
        assert_eq!(out.warnings, fresh, "call {round}");
    }
    // Every slot of the pool, at once, more than once.
    let calls = (0..HostConfig::default().max_concurrent_calls * 3).map(|_| {
        let (host, stateful) = (host.clone(), stateful.clone());
        tokio::spawn(async move { transform(&host, &stateful, Value::Null, Limits::DEFAULT).await })
    });
    for call in calls {
        let out = call.await.expect("join").expect("transform");
        assert_eq!(out.warnings, fresh);
    }
    // A call that trapped leaves nothing behind either.
    let bomb = load(&host, "hostile_memory_bomb").await;
    let small = Limits {
        memory_bytes: 16 << 20,
        ..Limits::DEFAULT
    };
    transform(&host, &bomb, Value::Null, small)
        .await
        .expect_err("memory");
    let out = transform(&host, &stateful, Value::Null, Limits::DEFAULT)
        .await
        .expect("transform");
    assert_eq!(out.warnings, fresh);
}

/// Timers are already due and clocks frozen: a plugin cannot hold its thread (and slot) by
/// waiting in a host call, where epoch deadlines do not reach.
#[tokio::test]
async fn a_sleeping_guest_cannot_wait_in_the_host() {
    let host = host();
    let sleeper = load(&host, "hostile_sleep").await;
    // An hour's sleep that waited would outlast the call's budget (the ceiling: far below the
    // hour, far above what the call needs) and fail it as a timeout; a result proves the sleep
    // returned at once. No bound on the elapsed time: that would measure the machine.
    let budget = Limits {
        timeout: Limits::CEILING.timeout,
        ..Limits::DEFAULT
    };
    let out = transform(&host, &sleeper, Value::Null, budget)
        .await
        .expect("returns within its budget");
    assert_eq!(out.warnings, ["slept 0ns", "wall clock 0s"]);
}

#[tokio::test]
async fn calls_wait_for_a_slot_and_give_up_within_their_budget() {
    let host = host_with(HostConfig {
        max_concurrent_calls: 1,
        cache_dir: Some(shared_cache()),
        ..HostConfig::default()
    });
    let looping = load(&host, "hostile_infinite_loop").await;
    let template = load(&host, "template").await;
    // The loop holds the only slot for far longer than the short call below waits (50x), so
    // the short call cannot outlive it however slow the machine.
    let budget = Limits {
        fuel: u64::MAX / 2,
        timeout: Duration::from_secs(5),
        ..Limits::DEFAULT
    };
    let spinning = {
        let host = host.clone();
        let looping = looping.clone();
        tokio::spawn(async move { transform(&host, &looping, Value::Null, budget).await })
    };
    let short = Limits {
        timeout: Duration::from_millis(100),
        ..Limits::DEFAULT
    };
    // Until the spawned loop has taken the slot, a short call may still find it free and run
    // (and succeed, or even outrun its short budget on a slow machine): try again, instead of
    // sleeping and hoping the loop got there first.
    let err = loop {
        match transform(&host, &template, Value::Null, short).await {
            Err(err @ PluginError::Busy(_)) => break err,
            _ => assert!(
                !spinning.is_finished(),
                "the loop ended before a call found the slot busy"
            ),
        }
    };
    assert_eq!(err, PluginError::Busy(short.timeout));
    let err = spinning.await.expect("join").expect_err("timeout");
    assert_eq!(err.kind(), ErrorKind::Timeout);
    // The slot came back once the loop was interrupted.
    transform(&host, &template, Value::Null, Limits::DEFAULT)
        .await
        .expect("slot free again");
}

/// Two slots, a namespace's share one: team-a's two endless calls hold one slot (the second
/// waits for a's share, holding none), so team-b's call runs beside them at once; a short call
/// of team-a's is told its share is busy.
#[tokio::test]
async fn one_namespaces_calls_hold_only_its_share_of_the_slots() {
    let host = host_with(HostConfig {
        max_concurrent_calls: 2,
        max_concurrent_calls_per_namespace: 1,
        cache_dir: Some(shared_cache()),
        ..HostConfig::default()
    });
    let looping = load(&host, "hostile_infinite_loop").await;
    let template = load(&host, "template").await;
    let in_ns = |ns: &str| CallSite::new("t").in_namespace(ns);
    let call = |module: Arc<Module>, ns: &'static str, limits: Limits| {
        let host = host.clone();
        async move {
            host.transform(
                &module,
                &input(bucket_program()),
                &Value::Null,
                limits,
                &in_ns(ns),
            )
            .await
        }
    };
    // Far longer than anything below takes, however slow the machine; aborted at the end.
    let endless = Limits {
        fuel: u64::MAX / 2,
        timeout: Duration::from_secs(60),
        ..Limits::DEFAULT
    };
    let loops: Vec<_> = (0..2)
        .map(|_| tokio::spawn(call(looping.clone(), "team-a", endless)))
        .collect();
    let short = Limits {
        timeout: Duration::from_millis(100),
        ..Limits::DEFAULT
    };
    // Until a loop has taken a's share, a short call of a's may still run: try again.
    let err = loop {
        match call(template.clone(), "team-a", short).await {
            Err(err @ PluginError::ShareBusy { .. }) => break err,
            other => assert!(
                loops.iter().any(|l| !l.is_finished()),
                "the loops ended before a's share was found busy: {other:?}"
            ),
        }
    };
    assert_eq!(err.kind(), ErrorKind::Busy);
    let text = err.to_string();
    assert!(
        text.contains("team-a") && text.contains("--plugin-max-concurrent-calls-per-namespace"),
        "{text}"
    );
    let output = call(template.clone(), "team-b", Limits::DEFAULT)
        .await
        .expect("team-b's call runs while team-a's loops hold their share");
    assert!(output.spec.contains_key("resources"));
    assert!(
        loops.iter().all(|l| !l.is_finished()),
        "team-b ran beside team-a's loops"
    );
    for l in loops {
        l.abort();
    }
}

#[tokio::test]
async fn outputs_are_deterministic_across_hosts() {
    let config =
        json!({"tags": {"a": "1"}, "namespaceTag": "ns", "targets": [{"typePrefix": "aws:"}]});
    let mut outputs = Vec::new();
    for _ in 0..2 {
        let host = host();
        let tags = load(&host, "default_tags").await;
        for _ in 0..3 {
            let out = transform(&host, &tags, config.clone(), Limits::DEFAULT)
                .await
                .expect("transform");
            outputs.push((serde_json::to_string(&out.spec).expect("json"), out.fuel));
        }
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]), "{outputs:?}");
}

#[tokio::test]
async fn the_precompiled_cache_is_used_and_a_corrupt_entry_is_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = HostConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..HostConfig::default()
    };
    let first = load(&host_with(config.clone()), "default_tags").await;
    assert_eq!(first.source(), LoadSource::Compiled);
    let files = cache_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");

    // The source says the cache was used; comparing load times would measure the machine.
    let second = load(&host_with(config.clone()), "default_tags").await;
    assert_eq!(second.source(), LoadSource::Cache);

    // A flipped byte fails the checksum: compiled again and the file rewritten.
    let mut data = std::fs::read(&files[0]).expect("read");
    let last = data.len() - 1;
    data[last] ^= 0xff;
    std::fs::write(&files[0], &data).expect("write");
    let host = host_with(config);
    let third = load(&host, "default_tags").await;
    assert_eq!(third.source(), LoadSource::Compiled);
    let out = transform(
        &host,
        &third,
        json!({"tags": {"a": "b"}, "targets": [{"typePrefix": "aws:"}]}),
        Limits::DEFAULT,
    )
    .await
    .expect("works after recompiling");
    assert_eq!(
        out.spec["resources"]["bucket"]["properties"]["tags"]["a"],
        "b"
    );
    assert_ne!(std::fs::read(&files[0]).expect("read"), data);
}

#[tokio::test]
async fn the_precompiled_cache_stays_within_its_size_and_keeps_what_is_used() {
    let dir = tempfile::tempdir().expect("tempdir");
    let unbounded = HostConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..HostConfig::default()
    };
    load(&host_with(unbounded.clone()), "default_tags").await;
    let one = cache_files(dir.path());
    assert_eq!(one.len(), 1);
    let size = std::fs::metadata(&one[0]).expect("size").len();
    // Room for about one module: loading a second evicts the first, never the new one.
    let bounded = HostConfig {
        cache_max_bytes: size + size / 2,
        ..unbounded
    };
    let host = host_with(bounded.clone());
    load(&host, "naming_policy").await;
    let files = cache_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    assert_ne!(
        files[0], one[0],
        "the least recently used module was evicted"
    );
    // The survivor is read from the cache by a new host; the evicted one is compiled again.
    let fresh = host_with(bounded);
    assert_eq!(
        load(&fresh, "naming_policy").await.source(),
        LoadSource::Cache
    );
    assert_eq!(
        load(&fresh, "default_tags").await.source(),
        LoadSource::Compiled
    );
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in walk(dir) {
        if entry.extension().and_then(|e| e.to_str()) == Some("cwasm") {
            out.push(entry);
        }
    }
    out
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn spec(value: Value) -> ProgramSpec {
    serde_json::from_value(value).expect("spec")
}

#[tokio::test]
async fn a_chain_runs_in_order_and_applies_its_failure_policies() {
    let host = host();
    let naming = load(&host, "naming_policy").await;
    let tags = load(&host, "default_tags").await;
    let trap = load(&host, "hostile_trap").await;
    let step = |id: &str, module: &Arc<Module>, config: Value, policy| Step {
        id: id.into(),
        priority: 0,
        policy,
        module: Ok(module.clone()),
        config,
        limits: Limits::DEFAULT,
    };
    // naming-policy with setWhenMissing on tags' own property path, then tags: the order shows.
    let chain = Chain {
        steps: vec![
            step(
                "T/naming",
                &naming,
                json!({"mode": "prefix"}),
                FailurePolicy::Fail,
            ),
            step("T/broken", &trap, Value::Null, FailurePolicy::Ignore),
            step(
                "T/tags",
                &tags,
                json!({"tags": {"x": "y"}, "targets": [{"typePrefix": "aws:"}]}),
                FailurePolicy::Fail,
            ),
        ],
    };
    let labels = BTreeMap::new();
    let out = chain::run(
        &host,
        &chain,
        "team-a",
        "web",
        &labels,
        &spec(bucket_program()),
    )
    .await
    .expect("chain");
    let resource = &out.spec.resources["bucket"];
    assert_eq!(resource.properties["name"], "team-a-logs");
    assert_eq!(resource.properties["tags"], json!({"x": "y"}));
    let applied: Vec<&str> = out.applied.iter().map(|a| a.id.as_str()).collect();
    assert_eq!(applied, ["T/naming", "T/tags"]);
    assert_eq!(out.applied[0].module, naming.digest());
    assert_eq!(out.skipped.len(), 1);
    assert_eq!(out.skipped[0].id, "T/broken");
    assert_eq!(out.skipped[0].error.kind(), ErrorKind::Trap);
    assert!(!out.transient());

    let mut failing = chain.clone();
    failing.steps[1].policy = FailurePolicy::Fail;
    let err = chain::run(
        &host,
        &failing,
        "team-a",
        "web",
        &labels,
        &spec(bucket_program()),
    )
    .await
    .expect_err("fails");
    assert_eq!(err.id, "T/broken");
    assert_eq!(err.error.kind(), ErrorKind::Trap);

    // A step whose module could not be loaded fails or is skipped the same way.
    let mut unloaded = chain.clone();
    unloaded.steps[0].module = Err(PluginError::ForbiddenImport {
        import: "wasi:http/types@0.2.6".into(),
        why: String::new(),
        granted: String::new(),
    });
    let err = chain::run(
        &host,
        &unloaded,
        "team-a",
        "web",
        &labels,
        &spec(bucket_program()),
    )
    .await
    .expect_err("fails");
    assert_eq!(err.id, "T/naming");
    assert_eq!(err.error.kind(), ErrorKind::ForbiddenImport);
}

#[tokio::test]
async fn invalid_program_output_is_refused_by_the_chain() {
    let host = host();
    let template = load(&host, "template").await;
    let chain = Chain {
        steps: vec![Step {
            id: "T/identity".into(),
            priority: 0,
            policy: FailurePolicy::Fail,
            module: Ok(template),
            config: Value::Null,
            limits: Limits::DEFAULT,
        }],
    };
    let out = chain::run(
        &host,
        &chain,
        "ns",
        "p",
        &BTreeMap::new(),
        &spec(bucket_program()),
    )
    .await
    .expect("identity");
    assert_eq!(out.spec, spec(bucket_program()));
}

#[tokio::test]
async fn every_call_is_counted_with_its_outcome_and_fuel() {
    let metrics = PluginMetrics::new();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let config = HostConfig {
        cache_dir: Some(shared_cache()),
        ..HostConfig::default()
    };
    let host = PluginHost::new(config, metrics).expect("host");
    let allow = load(&host, "resource_allowlist").await;
    let site = CallSite::new("ProgramTransform/ns/allow");
    for config in [json!({"allow": ["aws:*"]}), json!({"allow": ["gcp:*"]})] {
        let _ = host
            .transform(
                &allow,
                &input(bucket_program()),
                &config,
                Limits::DEFAULT,
                &site,
            )
            .await;
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    for needle in [
        r#"pko_plugin_calls_total{transform="ProgramTransform/ns/allow",plugin="resource-allowlist",function="transform",outcome="ok"} 1"#,
        r#"pko_plugin_calls_total{transform="ProgramTransform/ns/allow",plugin="resource-allowlist",function="transform",outcome="rejected"} 1"#,
        r#"pko_plugin_errors_total{transform="ProgramTransform/ns/allow",plugin="resource-allowlist",kind="rejected"} 1"#,
        r#"pko_plugin_call_duration_seconds_count{transform="ProgramTransform/ns/allow",plugin="resource-allowlist"} 2"#,
        r#"pko_plugin_fuel_consumed_count{transform="ProgramTransform/ns/allow",plugin="resource-allowlist"} 1"#,
        r#"pko_plugin_module_load_duration_seconds_count{source="#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

/// The conformance fixtures shipped with each plugin pass (what `plugin test` runs).
#[tokio::test]
async fn plugin_fixtures_pass() {
    let host = host();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../plugins");
    for (dir, module) in [
        ("default-tags", "default_tags"),
        ("naming-policy", "naming_policy"),
        ("resource-allowlist", "resource_allowlist"),
        ("template", "template"),
        // The Python and JavaScript twins pass their Rust twin's fixtures.
        ("default-tags", "python_example"),
        ("naming-policy", "js_example"),
    ] {
        let module = load(&host, module).await;
        let results = conformance::run_dir(&host, &module, &root.join(dir).join("tests"))
            .await
            .expect("fixtures");
        assert!(results.len() >= 2, "{dir}: {} cases", results.len());
        let failed: Vec<String> = results
            .iter()
            .filter_map(|r| r.outcome.as_ref().err().map(|e| format!("{}: {e}", r.name)))
            .collect();
        assert!(failed.is_empty(), "{dir}:\n{}", failed.join("\n"));
    }
}

#[tokio::test]
async fn conformance_reports_mismatches() {
    let host = host();
    let module = load(&host, "template").await;
    let case: conformance::Case = serde_json::from_value(json!({
        "input": {"program": {"outputs": {"a": 1}}},
        "expect": {"program": {"outputs": {"a": 2}}},
    }))
    .expect("case");
    let err = conformance::run_case(&host, &module, &case)
        .await
        .expect_err("mismatch");
    assert!(err.contains("program differs"), "{err}");
    let case: conformance::Case = serde_json::from_value(json!({
        "input": {},
        "expect": {"error": {"kind": "rejected"}},
    }))
    .expect("case");
    let err = conformance::run_case(&host, &module, &case)
        .await
        .expect_err("no error");
    assert!(err.contains("expected a rejected error"), "{err}");
}

/// The SDK crate and the Python and JavaScript plugins carry their own copy of the WIT (so each
/// builds outside this repository): every copy is the host's.
#[test]
fn every_vendored_wit_is_the_hosts() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let wit = std::fs::read_to_string(root.join("wit/transform.wit")).expect("wit");
    for copy in [
        "plugins/sdk/wit/transform.wit",
        "plugins/python-example/wit/transform.wit",
        "plugins/js-example/wit/transform.wit",
    ] {
        let text = std::fs::read_to_string(root.join(copy)).expect(copy);
        assert!(
            text == wit,
            "{copy} differs from wit/transform.wit: copy it again"
        );
    }
}
