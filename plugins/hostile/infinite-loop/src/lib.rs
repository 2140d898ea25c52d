//! Hostile test plugin: spins forever.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-infinite-loop", "spins forever")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let _ = input;
        let mut n = 0u64;
        loop {
            n = std::hint::black_box(n.wrapping_add(1));
        }
    }
}

pko_transform_sdk::export_plugin!(Hostile);
