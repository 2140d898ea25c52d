//! Module compiles under their bounds: each runs in a child process with a data limit and a
//! deadline, so a module that makes the compiler grow or run long fails its own transform with
//! the bound named, while the operator and every other transform go on; and one namespace's
//! loads hold at most its share of the load slots.

use pko_tests::plugins::costly;

use super::*;

/// Waits until `name`'s Ready condition is False with `reason`; returns its message.
async fn refused(transforms: &Api<ProgramTransform>, name: &str, reason: &str) -> String {
    let status = transform_status(
        || async { transforms.get(name).await.ok()?.status },
        &format!("{name}: Ready False, {reason}"),
        |s| ready_condition(s).is_some_and(|(st, r, _)| st == "False" && r == reason),
    )
    .await;
    let (_, _, message) = ready_condition(&status).expect("ready");
    message.to_owned()
}

/// A 700 KB component whose one function needs over 100 MiB to compile, under a 32 MiB bound
/// (and a deadline far away, so only the memory bound can end it): its transform says
/// `Compile` and names the bound and its flag; the operator process is the same, and a real
/// plugin in the same namespace loads and transforms its Program. Without the bound the
/// compile ran in the operator's own process, as big as the module asked.
#[tokio::test]
async fn a_module_that_needs_more_memory_to_compile_than_its_bound_fails_alone() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("tf-compile-mem").await.expect("namespace");
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: Some(ADVERTISED.into()),
            args: vec![
                format!("--watch-namespace={ns}"),
                "--plugin-compile-memory-mib=32".into(),
                "--plugin-compile-timeout-seconds=3600".into(),
                "--plugin-load-timeout-seconds=3600".into(),
            ],
        },
    )
    .await
    .expect("operator starts");
    let pid = op.pid();
    let bomb = costly::memory_bomb(100_000);
    let tags = module("default_tags").expect("module");
    config_map(plane, &ns, "plugins", &[("bomb", &bomb), ("tags", &tags)]).await;
    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &ns);
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    for (name, key, m) in [("bomb", "bomb", &bomb), ("tags", "tags", &tags)] {
        transforms
            .create(
                &PostParams::default(),
                &transform(
                    name,
                    from_config_map(
                        "plugins",
                        key,
                        m,
                        json!({
                            "config": {"tags": {"team": name}, "targets": [{"typePrefix": "aws:"}]},
                            "programSelector": {"matchLabels": {"app": name}},
                        }),
                    ),
                ),
            )
            .await
            .expect("transform");
    }
    let message = refused(&transforms, "bomb", "Compile").await;
    assert!(
        message.contains("needs more than 32 MiB (--plugin-compile-memory-mib)"),
        "{message}"
    );
    programs
        .create(
            &PostParams::default(),
            &program("tagged", &[("app", "tags")], bucket_spec()),
        )
        .await
        .expect("program");
    ready_reason(&op, &programs, "tagged", "ArtifactReady").await;
    assert_eq!(op.pid(), pid, "the operator never restarted");
}

/// A 28 MB component of 4,000 functions, each cheap in memory, whose compile takes over a
/// minute, under a 1 s deadline (and the default memory bound, which it stays far below): the
/// compiler is killed at the deadline and the transform says `Timeout`, naming the flag.
#[tokio::test]
async fn a_module_whose_compile_outlasts_its_deadline_is_killed() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("tf-compile-time").await.expect("namespace");
    let slow = costly::slow(4_000, 1_000);
    let (port, op) = https_module_server(
        plane,
        &ns,
        &slow.bytes,
        &[
            "--plugin-compile-timeout-seconds=1",
            "--plugin-load-timeout-seconds=3600",
        ],
    )
    .await;
    let pid = op.pid();
    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &ns);
    transforms
        .create(
            &PostParams::default(),
            &transform(
                "slow",
                https_module(&format!("127.0.0.1:{port}"), "/slow.wasm", &slow.sha256),
            ),
        )
        .await
        .expect("transform");
    let message = refused(&transforms, "slow", "Timeout").await;
    assert!(
        message.contains("took longer than 1s (--plugin-compile-timeout-seconds)"),
        "{message}"
    );
    assert_eq!(op.pid(), pid, "the operator never restarted");
}

/// Two load slots, a namespace's share one: tenant a's three modules come from a server that
/// holds every answer, so a's first load holds its share and the other two wait for it,
/// leaving the second slot free; tenant b's module (a ConfigMap) loads at once while a's are
/// still held. Opened, the server answers and a's three load.
#[tokio::test]
async fn one_namespaces_stalled_module_server_leaves_another_namespaces_loads_running() {
    use std::sync::atomic::Ordering::SeqCst;
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let a = plane.namespace("tf-share-a").await.expect("namespace");
    let b = plane.namespace("tf-share-b").await.expect("namespace");
    let tags = module("default_tags").expect("module");
    let gate = std::sync::Arc::new(Gate::default());
    let (port, ca) = https_server_with(tags.bytes.clone(), Some(gate.clone()));
    let ca_file = plane.dir().join(format!("plugin-ca-{a}.pem"));
    std::fs::write(&ca_file, ca).expect("write CA");
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: Some(ADVERTISED.into()),
            args: vec![
                format!("--watch-namespaces={a},{b}"),
                format!("--plugin-ca-file={}", ca_file.display()),
                "--plugin-max-concurrent-loads=2".into(),
                "--plugin-load-timeout-seconds=600".into(),
            ],
        },
    )
    .await
    .expect("operator starts");
    let a_transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &a);
    for i in 0..3 {
        let spec = https_module(
            &format!("127.0.0.1:{port}"),
            &format!("/a{i}"),
            &tags.sha256,
        );
        a_transforms
            .create(&PostParams::default(), &transform(&format!("a{i}"), spec))
            .await
            .expect("transform");
    }
    let held = wait_for("one of a's loads held, two waiting", WAIT, || async {
        let waiting = op.metric("pko_plugin_module_loads_waiting").await?;
        (gate.held.load(SeqCst) == 1 && waiting == 2.0).then_some(())
    })
    .await;
    if let Err(e) = held {
        gate.open();
        panic!("{e}: held {}\n{}", gate.held.load(SeqCst), op.log_text());
    }
    config_map(plane, &b, "plugins", &[("tags", &tags)]).await;
    let b_transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &b);
    b_transforms
        .create(
            &PostParams::default(),
            &transform(
                "b",
                from_config_map(
                    "plugins",
                    "tags",
                    &tags,
                    json!({"config": {"tags": {"team": "b"}, "targets": [{"typePrefix": "aws:"}]}}),
                ),
            ),
        )
        .await
        .expect("transform");
    let b_ready = wait_for("tenant b's transform ready", WAIT, || async {
        let status = b_transforms.get("b").await.ok()?.status?;
        ready_condition(&status)
            .is_some_and(|(st, _, _)| st == "True")
            .then_some(())
    })
    .await;
    let still_held = gate.held.load(SeqCst);
    gate.open();
    b_ready.unwrap_or_else(|e| panic!("{e}: b waits behind a's held loads\n{}", op.log_text()));
    assert_eq!(still_held, 1, "a's load was still held when b's was ready");
    assert_eq!(gate.most_held.load(SeqCst), 1, "a held more than its share");
    for i in 0..3 {
        let name = format!("a{i}");
        transform_status(
            || async { a_transforms.get(&name).await.ok()?.status },
            "a's held module loads",
            |s| ready_condition(s).is_some_and(|(st, _, _)| st == "True"),
        )
        .await;
    }
}
