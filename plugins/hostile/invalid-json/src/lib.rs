//! Hostile test plugin: returns a spec that is not JSON.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-invalid-json", "returns a spec that is not JSON")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let _ = input;
        Ok(Output {
            spec_json: "{\"resources\": {not json".into(),
            warnings: Vec::new(),
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
