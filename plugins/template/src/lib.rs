//! The plugin template: returns the Program unchanged and, when configured with a `note`, adds
//! it as a warning. Copy this crate to write a plugin; `cargo build --release --target
//! wasm32-wasip2` writes `template.wasm`, a component ready to load.

use pko_transform_sdk::{Level, Output, PluginInfo, Program, TransformError, Transformer};
use serde::Deserialize;

/// The configuration (`spec.config` of the transform object).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    /// Added to every Program's warnings when set.
    note: Option<String>,
}

struct Template;

impl Transformer for Template {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("template", "returns the Program unchanged")
    }

    fn validate_config(config_json: String) -> Result<(), TransformError> {
        pko_transform_sdk::parse_config::<Config>(&config_json).map(|_| ())
    }

    fn transform(input: Program, config_json: String) -> Result<Output, TransformError> {
        let config: Config = pko_transform_sdk::parse_config(&config_json)?;
        let spec = input.spec()?;
        pko_transform_sdk::log(
            Level::Debug,
            &format!(
                "{}/{}: {} top-level keys",
                input.namespace,
                input.name,
                spec.len()
            ),
        );
        Output::new(spec, config.note.into_iter().collect())
    }
}

pko_transform_sdk::export_plugin!(Template);
