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

/// Runs the benchmark and returns its Markdown section.
pub async fn run() -> Result<String, PluginBenchError> {
    let modules: Vec<(&str, PluginModule)> = PLUGINS
        .iter()
        .map(|(name, file)| Ok((*name, module(file)?)))
        .collect::<Result<_, crate::HarnessError>>()?;
    let cache = tempfile::tempdir()?;
    let mut out = String::new();
    writeln!(out, "## Transform plugins\n")?;
    writeln!(
        out,
        "In-process, release build, wasmtime 48 with the pooling allocator, fuel and epoch \
         interruption on; every call gets a fresh `Store` and instance. The Program has 24 \
         resources (~{} bytes of JSON) and the label `team=blue`; each plugin is configured to \
         change it (tags on 16 resources, prefixes on 8 names, an allowlist that passes).\n",
        serde_json::to_string(&sample_spec())
            .map(|s| s.len())
            .unwrap_or(0),
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
        "`validate-config` is instantiation plus a trivial call; `transform` adds the spec's \
         round trip as JSON text and the plugin's work.\n"
    )?;
    writeln!(
        out,
        "| plugin | validate-config p50 | p99 | transform p50 | p99 | mean | fuel per transform |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|")?;
    for ((name, _), (module, config)) in modules.iter().zip(loaded.iter().zip(configs())) {
        let mut validate = Vec::with_capacity(CALLS);
        let mut transform = Vec::with_capacity(CALLS);
        let mut fuel = 0;
        for _ in 0..CALLS {
            let started = Instant::now();
            host.validate_config(module, &config, limits, &site).await?;
            validate.push(started.elapsed());
            let started = Instant::now();
            let output = host
                .transform(module, &input, &config, limits, &site)
                .await?;
            transform.push(started.elapsed());
            fuel = output.fuel;
        }
        let (v50, v99, _) = percentiles(validate);
        let (t50, t99, mean) = percentiles(transform);
        writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {fuel} |",
            us(v50),
            us(v99),
            us(t50),
            us(t99),
            us(mean)
        )?;
        println!(
            "plugin {name}: validate p50 {v50:?}, transform p50 {t50:?} p99 {t99:?}, fuel {fuel}"
        );
    }

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
        "\nThe sandbox costs {:.1}× the native time per Program (mean). With {PARALLEL} chains in \
         flight: {:.0} Programs/s.\n",
        wmean.as_secs_f64() / nmean.as_secs_f64().max(1e-9),
        CALLS as f64 / parallel.as_secs_f64()
    )?;
    println!(
        "chain: wasm p50 {w50:?} p99 {w99:?}; native p50 {n50:?} p99 {n99:?}; parallel {:.0}/s",
        CALLS as f64 / parallel.as_secs_f64()
    );
    Ok(out)
}
