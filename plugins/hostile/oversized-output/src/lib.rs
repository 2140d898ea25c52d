//! Hostile test plugin: returns an 8 MiB spec.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-oversized-output", "returns an 8 MiB spec")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let _ = input;
        let big = "x".repeat(8 << 20);
        Ok(Output {
            spec_json: format!("{{\"variables\":{{\"big\":\"{big}\"}}}}"),
            warnings: Vec::new(),
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
