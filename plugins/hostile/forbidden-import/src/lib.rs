//! Hostile test plugin: reads a file, so it imports wasi:filesystem.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "hostile-forbidden-import",
            "reads a file, so it imports wasi:filesystem"
        )
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let text = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        Ok(Output {
            spec_json: input.spec_json,
            warnings: vec![text],
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
