//! Hostile test plugin: reads a file. It imports wasi:filesystem, which the host links only to
//! deny: it loads, and its transform fails naming the function it called.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "hostile-reads-file",
            "reads a file, which plugins are denied"
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
