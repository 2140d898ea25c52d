//! The transform-plugin section of `make bench`: what a chain of the three plugins costs per
//! Program, next to the same transforms compiled natively; the latency of one call on a fresh
//! instance; compile and precompiled-cache load times. In-process, no control plane.
//!
//! The native side compiles the plugins' own `logic.rs` files (pure Rust on serde_json, no
//! bindings), so both sides run the same transform code and differ only by the sandbox:
//! instantiation, copying the spec in and out as JSON text, fuel and epoch checks.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pko_api::program::ProgramSpec;
use pko_plugin_host::chain::{self, Chain, FailurePolicy, Step, validate_spec};
use pko_plugin_host::{
    CallSite, HostConfig, LoadSource, Module, PluginError, PluginHost, PluginMetrics, ProgramInput,
};
use serde_json::{Map, Value, json};

use crate::plugins::{PluginModule, module};

// The plugins' transform code, compiled natively. Not every item is used here.
#[allow(dead_code)]
#[path = "../../plugins/default-tags/src/logic.rs"]
mod default_tags;
#[allow(dead_code)]
#[path = "../../plugins/naming-policy/src/logic.rs"]
mod naming_policy;
#[allow(dead_code)]
#[path = "../../plugins/resource-allowlist/src/logic.rs"]
mod resource_allowlist;

/// Failures of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum PluginBenchError {
    #[error(transparent)]
    Harness(#[from] crate::HarnessError),
    #[error("plugin: {0}")]
    Plugin(#[from] PluginError),
    #[error("chain step {0}")]
    Chain(String),
    #[error("native transform: {0}")]
    Native(String),
    #[error(transparent)]
    Fmt(#[from] std::fmt::Error),
    #[error("cannot create the cache folder: {0}")]
    Io(#[from] std::io::Error),
}

/// Calls measured per plugin and per chain.
const CALLS: usize = 2000;
/// Compilations measured per plugin.
const COMPILES: usize = 5;
/// Chains run at once in the throughput run (the host's default slot count).
const PARALLEL: usize = 4;

const PLUGINS: [(&str, &str); 3] = [
    ("default-tags", "default_tags"),
    ("naming-policy", "naming_policy"),
    ("resource-allowlist", "resource_allowlist"),
];

fn configs() -> [Value; 3] {
    [
        json!({
            "tags": {"managed-by": "pko-rs", "cost-center": "cc-42"},
            "fromLabels": {"team": "team"},
            "targets": [{"typePrefix": "aws:"}, {"typePrefix": "kubernetes:", "property": "metadata.labels"}],
        }),
        json!({"mode": "prefix", "typePrefixes": ["aws:"]}),
        json!({"allow": ["aws:s3*", "random:*", "kubernetes:core/v1:*"]}),
    ]
}

/// A Program of 24 resources (buckets, ConfigMaps, random pets), ~2.4 KB of JSON.
fn sample_spec() -> Value {
    let mut resources = Map::new();
    for i in 0..8 {
        resources.insert(
            format!("bucket-{i}"),
            json!({"type": "aws:s3/bucket:Bucket", "properties": {"name": format!("logs-{i}"), "tags": {"app": "web"}}}),
        );
        resources.insert(
            format!("config-{i}"),
            json!({"type": "kubernetes:core/v1:ConfigMap", "properties": {"metadata": {"name": format!("cfg-{i}")}, "data": {"key": "value"}}}),
        );
        resources.insert(
            format!("pet-{i}"),
            json!({"type": "random:index/randomPet:RandomPet", "properties": {"length": 2}}),
        );
    }
    json!({
        "resources": resources,
        "outputs": {"first": "${bucket-0.id}"},
        "variables": {"region": "eu-west-1"},
    })
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("team".to_owned(), "blue".to_owned())])
}

/// The 1-minute load average (`?` when unknown).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// p50, p99 and mean of `samples`.
fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).copied().unwrap_or_default()
    };
    let total: Duration = samples.iter().sum();
    let mean = total / u32::try_from(samples.len().max(1)).unwrap_or(u32::MAX);
    (at(0.5), at(0.99), mean)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

async fn load(host: &PluginHost, m: &PluginModule) -> Result<Arc<Module>, PluginError> {
    host.load(m.bytes.clone(), &m.sha256, &CallSite::new("bench"))
        .await
}

fn host(cache_dir: Option<std::path::PathBuf>) -> Result<PluginHost, PluginError> {
    PluginHost::new(
        HostConfig {
            cache_dir,
            ..HostConfig::default()
        },
        PluginMetrics::new(),
    )
}

/// Latencies of one plugin's calls, each on a fresh instance.
struct OneCall {
    /// p50 of the instantiation inside `transform` calls.
    instantiate: Duration,
    /// p50, p99, mean.
    validate: (Duration, Duration, Duration),
    transform: (Duration, Duration, Duration),
    fuel: u64,
}

async fn one_call(
    host: &PluginHost,
    module: &Arc<Module>,
    input: &ProgramInput,
    config: &Value,
    site: &CallSite,
) -> Result<OneCall, PluginBenchError> {
    let limits = host.config().default_limits;
    let mut validate = Vec::with_capacity(CALLS);
    let mut transform = Vec::with_capacity(CALLS);
    let mut instantiate = Vec::with_capacity(CALLS);
    let mut fuel = 0;
    for _ in 0..CALLS {
        let started = Instant::now();
        host.validate_config(module, config, limits, site).await?;
        validate.push(started.elapsed());
        let started = Instant::now();
        let output = host.transform(module, input, config, limits, site).await?;
        transform.push(started.elapsed());
        instantiate.push(output.instantiate);
        fuel = output.fuel;
    }
    Ok(OneCall {
        instantiate: percentiles(instantiate).0,
        validate: percentiles(validate),
        transform: percentiles(transform),
        fuel,
    })
}

/// The three native transforms, each behind the same boundary the plugins have: the spec goes
/// in and comes out as JSON text and is validated as a Program spec.
fn native_chain(
    spec: &ProgramSpec,
    labels: &BTreeMap<String, String>,
) -> Result<ProgramSpec, PluginBenchError> {
    let [tags_config, naming_config, allow_config] = configs();
    let native = |e: String| PluginBenchError::Native(e);
    let tags: default_tags::Config =
        serde_json::from_value(tags_config).map_err(|e| native(e.to_string()))?;
    default_tags::check_config(&tags).map_err(|e| native(format!("{e:?}")))?;
    let naming: naming_policy::Config =
        serde_json::from_value(naming_config).map_err(|e| native(e.to_string()))?;
    let naming = naming_policy::policy(naming).map_err(|e| native(format!("{e:?}")))?;
    let allow: resource_allowlist::Config =
        serde_json::from_value(allow_config).map_err(|e| native(e.to_string()))?;
    resource_allowlist::check_config(&allow).map_err(|e| native(format!("{e:?}")))?;

    let mut current = spec.clone();
    for step in 0..3 {
        let text = serde_json::to_string(&current).map_err(|e| native(e.to_string()))?;
        let mut map: Map<String, Value> =
            serde_json::from_str(&text).map_err(|e| native(e.to_string()))?;
        match step {
            0 => {
                default_tags::transform("team-a", labels, &mut map, &tags);
            }
            1 => {
                naming_policy::transform("team-a", &mut map, &naming)
                    .map_err(|e| native(format!("{e:?}")))?;
            }
            _ => {
                resource_allowlist::transform(&map, &allow)
                    .map_err(|e| native(format!("{e:?}")))?;
            }
        }
        let out = serde_json::to_string(&Value::Object(map)).map_err(|e| native(e.to_string()))?;
        let map: Map<String, Value> =
            serde_json::from_str(&out).map_err(|e| native(e.to_string()))?;
        current = validate_spec(map).map_err(|e| native(e.to_string()))?;
    }
    Ok(current)
}

/// Calls measured per interpreted plugin (each takes milliseconds).
const INTERPRETED_CALLS: usize = 200;
/// Compilations measured per interpreted plugin (each takes seconds).
const INTERPRETED_COMPILES: usize = 3;

/// The Python and JavaScript plugins next to their Rust twins: module size, compile and cache
/// load, then instantiate and transform latency on the same Program and configuration; each
/// twin's output is checked to be the Rust one's.
async fn interpreted(
    out: &mut String,
    shared: &PluginHost,
    cache: &std::path::Path,
    input: &ProgramInput,
    site: &CallSite,
) -> Result<(), PluginBenchError> {
    let [tags, naming, _] = configs();
    let rows = [
        ("Rust", "default-tags", "default_tags", &tags),
        ("Python", "python-example", "python_example", &tags),
        ("Rust", "naming-policy", "naming_policy", &naming),
        ("JavaScript", "js-example", "js_example", &naming),
    ];
    writeln!(
        out,
        "\n### Per language: the Python and JavaScript twins next to the Rust plugins\n"
    )?;
    writeln!(
        out,
        "`python-example` (componentize-py 0.25.1, CPython) is `default-tags` and `js-example` \
         (componentize-js 0.23.0, SpiderMonkey) is `naming-policy`, on the same Program and \
         configuration (their outputs are checked equal). Compile: median of \
         {INTERPRETED_COMPILES}; calls: {INTERPRETED_CALLS} each, on a fresh instance.\n"
    )?;
    writeln!(
        out,
        "| language | plugin | module | compile | cache load | instantiate p50 | p99 | transform p50 | p99 | fuel per transform |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let limits = shared.config().default_limits;
    let mut rust_output = None;
    for (language, name, file, config) in rows {
        let m = module(file)?;
        let mut compiled = Vec::new();
        for _ in 0..INTERPRETED_COMPILES {
            compiled.push(load(&host(None)?, &m).await?.load_time());
        }
        load(&host(Some(cache.to_path_buf()))?, &m).await?;
        let from_cache = load(&host(Some(cache.to_path_buf()))?, &m)
            .await?
            .load_time();
        let module = load(shared, &m).await?;
        let mut instantiate = Vec::with_capacity(INTERPRETED_CALLS);
        let mut transform = Vec::with_capacity(INTERPRETED_CALLS);
        let mut last = None;
        for _ in 0..INTERPRETED_CALLS {
            let started = Instant::now();
            let output = shared
                .transform(&module, input, config, limits, site)
                .await?;
            transform.push(started.elapsed());
            instantiate.push(output.instantiate);
            last = Some(output);
        }
        let output = last.ok_or_else(|| PluginBenchError::Native("no call".into()))?;
        if language == "Rust" {
            rust_output = Some(output.spec.clone());
        } else if rust_output.as_ref() != Some(&output.spec) {
            return Err(PluginBenchError::Native(format!(
                "{name} and its Rust twin disagree"
            )));
        }
        let (compile, _, _) = percentiles(compiled);
        let (i50, i99, _) = percentiles(instantiate);
        let (t50, t99, _) = percentiles(transform);
        writeln!(
            out,
            "| {language} | {name} | {:.1} MB | {} | {} | {} | {} | {} | {} | {} |",
            m.bytes.len() as f64 / 1e6,
            ms(compile),
            ms(from_cache),
            us(i50),
            us(i99),
            us(t50),
            us(t99),
            output.fuel
        )?;
        println!(
            "{language} {name}: compile {compile:?}, cache load {from_cache:?}, instantiate p50 {i50:?} p99 {i99:?}, transform p50 {t50:?} p99 {t99:?}, fuel {}",
            output.fuel
        );
    }
    Ok(())
}

/// Runs the benchmark and returns its Markdown section.
pub async fn run() -> Result<String, PluginBenchError> {
    let modules: Vec<(&str, PluginModule)> = PLUGINS
        .iter()
        .map(|(name, file)| Ok((*name, module(file)?)))
        .collect::<Result<_, crate::HarnessError>>()?;
    let cache = tempfile::tempdir()?;
    let mut out = String::new();
    writeln!(out, "## Transform plugins\n")?;
    let allocation = if host(None)?.pooled() {
        "the pooling allocator (copy-on-write memory images, slots reset in place)"
    } else {
        "on-demand allocation (the instance pool could not be reserved here)"
    };
    writeln!(
        out,
        "In-process, release build, wasmtime 48 with {allocation}, fuel and epoch \
         interruption on; every call gets a fresh `Store` and instance, run on the calling \
         task. The Program has 24 resources (~{} bytes of JSON) and the label `team=blue`; each \
         plugin is configured to change it (tags on 16 resources, prefixes on 8 names, an \
         allowlist that passes). Load average when the run started: {}.\n",
        serde_json::to_string(&sample_spec())
            .map(|s| s.len())
            .unwrap_or(0),
        load_average(),
    )?;

    // Compile and precompiled-cache load.
    writeln!(out, "### Loading a module\n")?;
    writeln!(
        out,
        "| plugin | size | compile (median of {COMPILES}) | load from the precompiled cache (median of {COMPILES}) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|")?;
    for (name, m) in &modules {
        let mut compiled = Vec::new();
        let mut cached = Vec::new();
        for _ in 0..COMPILES {
            let module = load(&host(None)?, m).await?;
            compiled.push(module.load_time());
        }
        // Warm the cache, then measure loads from it.
        load(&host(Some(cache.path().to_path_buf()))?, m).await?;
        for _ in 0..COMPILES {
            let module = load(&host(Some(cache.path().to_path_buf()))?, m).await?;
            if module.source() != LoadSource::Cache {
                return Err(PluginBenchError::Native("the cache was not used".into()));
            }
            cached.push(module.load_time());
        }
        let (compile, _, _) = percentiles(compiled);
        let (from_cache, _, _) = percentiles(cached);
        writeln!(
            out,
            "| {name} | {} KB | {} | {} |",
            m.bytes.len() / 1024,
            ms(compile),
            ms(from_cache)
        )?;
        println!("plugin {name}: compile {compile:?}, cache load {from_cache:?}");
    }

    // One call on a fresh instance.
    let host = host(Some(cache.path().to_path_buf()))?;
    let loaded: Vec<Arc<Module>> = {
        let mut v = Vec::new();
        for (_, m) in &modules {
            v.push(load(&host, m).await?);
        }
        v
    };
    let spec = sample_spec();
    let input = ProgramInput {
        namespace: "team-a".into(),
        name: "web".into(),
        labels: labels(),
        spec: spec.clone(),
    };
    let site = CallSite::new("bench");
    let limits = host.config().default_limits;
    writeln!(
        out,
        "\n### One call, fresh instance each time ({CALLS} calls each)\n"
    )?;
    writeln!(
        out,
        "`instantiate` is creating the call's store and instance; `validate-config` is a whole \
         call with trivial work (slot, store, instance, call, teardown, metrics); `transform` \
         adds the spec's round trip as JSON text and the plugin's work.\n"
    )?;
    writeln!(
        out,
        "| plugin | instantiate p50 | validate-config p50 | p99 | transform p50 | p99 | mean | fuel per transform |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    for ((name, _), (module, config)) in modules.iter().zip(loaded.iter().zip(configs())) {
        let row = one_call(&host, module, &input, &config, &site).await?;
        writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
            us(row.instantiate),
            us(row.validate.0),
            us(row.validate.1),
            us(row.transform.0),
            us(row.transform.1),
            us(row.transform.2),
            row.fuel
        )?;
        println!(
            "plugin {name}: instantiate p50 {:?}, validate p50 {:?}, transform p50 {:?} p99 {:?}, fuel {}",
            row.instantiate, row.validate.0, row.transform.0, row.transform.1, row.fuel
        );
    }

    interpreted(&mut out, &host, cache.path(), &input, &site).await?;

    // The JSON text boundary: the template plugin parses the spec and writes it back
    // unchanged, so its transform minus its validate-config is the whole round trip (host
    // encode, copy in, guest parse and write, copy out, host parse); the host's share is
    // timed alone.
    let template = load(&host, &module("template")?).await?;
    let identity = one_call(&host, &template, &input, &Value::Null, &site).await?;
    let mut host_side = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let started = Instant::now();
        let text = pko_plugin_host::json::canonical_string(&input.spec);
        let back: Map<String, Value> =
            serde_json::from_str(&text).map_err(|e| PluginBenchError::Native(e.to_string()))?;
        let checked = validate_spec(back)?;
        host_side.push(started.elapsed());
        std::hint::black_box(checked);
    }
    let (h50, _, _) = percentiles(host_side);
    let boundary = identity.transform.0.saturating_sub(identity.validate.0);
    writeln!(
        out,
        "\nThe JSON text boundary (the template plugin, which returns the spec unchanged): \
         transform p50 {} against validate-config p50 {}, so the round trip costs about {} per \
         call, of which {} on the host (encode with sorted keys, parse, validate as a Program \
         spec) and the rest in the guest's parse and write.",
        us(identity.transform.0),
        us(identity.validate.0),
        us(boundary),
        us(h50),
    )?;
    println!(
        "boundary: identity transform p50 {:?}, validate p50 {:?}, host side p50 {h50:?}",
        identity.transform.0, identity.validate.0
    );

    // The three as a chain, per Program, against the same code run natively.
    let chain = Chain {
        steps: PLUGINS
            .iter()
            .zip(loaded.iter().zip(configs()))
            .enumerate()
            .map(|(i, ((name, _), (module, config)))| Step {
                id: format!("ProgramTransform/bench/{name}"),
                priority: i32::try_from(i).unwrap_or_default(),
                policy: FailurePolicy::Fail,
                module: Ok(module.clone()),
                config,
                limits,
            })
            .collect(),
    };
    let typed: ProgramSpec =
        serde_json::from_value(spec).map_err(|e| PluginBenchError::Native(e.to_string()))?;
    let labels = labels();
    let mut wasm = Vec::with_capacity(CALLS);
    let mut wasm_result = None;
    for _ in 0..CALLS {
        let started = Instant::now();
        let result = chain::run(&host, &chain, "team-a", "web", &labels, &typed)
            .await
            .map_err(|e| PluginBenchError::Chain(e.to_string()))?;
        wasm.push(started.elapsed());
        wasm_result = Some(result.spec);
    }
    let mut native = Vec::with_capacity(CALLS);
    let mut native_result = None;
    for _ in 0..CALLS {
        let started = Instant::now();
        let result = native_chain(&typed, &labels)?;
        native.push(started.elapsed());
        native_result = Some(result);
    }
    if wasm_result != native_result {
        return Err(PluginBenchError::Native(
            "the native chain and the plugin chain disagree".into(),
        ));
    }
    // Throughput: chains in flight on every slot of the host.
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..PARALLEL {
        let (host, chain, typed, labels) =
            (host.clone(), chain.clone(), typed.clone(), labels.clone());
        tasks.spawn(async move {
            for _ in 0..CALLS / PARALLEL {
                chain::run(&host, &chain, "team-a", "web", &labels, &typed)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| PluginBenchError::Chain(e.to_string()))?
            .map_err(PluginBenchError::Chain)?;
    }
    let parallel = started.elapsed();

    let (w50, w99, wmean) = percentiles(wasm);
    let (n50, n99, nmean) = percentiles(native);
    writeln!(
        out,
        "\n### A chain of the three, per Program ({CALLS} Programs)\n"
    )?;
    writeln!(
        out,
        "Native: the same `logic.rs` code compiled into the operator, with the same JSON text \
         boundary and spec validation per step; both produce the same spec (checked).\n"
    )?;
    writeln!(out, "| | p50 | p99 | mean | Programs/s (one at a time) |")?;
    writeln!(out, "|---|---:|---:|---:|---:|")?;
    writeln!(
        out,
        "| plugins (wasm) | {} | {} | {} | {:.0} |",
        us(w50),
        us(w99),
        us(wmean),
        1.0 / wmean.as_secs_f64()
    )?;
    writeln!(
        out,
        "| native Rust | {} | {} | {} | {:.0} |",
        us(n50),
        us(n99),
        us(nmean),
        1.0 / nmean.as_secs_f64()
    )?;
    writeln!(
        out,
        "\nThe sandbox costs {:.1}× the native time per Program at p50 ({:.1}× mean). With \
         {PARALLEL} chains in flight: {:.0} Programs/s.\n",
        w50.as_secs_f64() / n50.as_secs_f64().max(1e-9),
        wmean.as_secs_f64() / nmean.as_secs_f64().max(1e-9),
        CALLS as f64 / parallel.as_secs_f64()
    )?;
    println!(
        "chain: wasm p50 {w50:?} p99 {w99:?}; native p50 {n50:?} p99 {n99:?}; parallel {:.0}/s",
        CALLS as f64 / parallel.as_secs_f64()
    );
    Ok(out)
}
