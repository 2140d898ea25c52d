//! Hostile test plugin: panics, which aborts (a wasm trap).

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-trap", "panics, which aborts (a wasm trap)")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        panic!("hostile plugin: deliberate panic for {}", input.name)
    }
}

pko_transform_sdk::export_plugin!(Hostile);
