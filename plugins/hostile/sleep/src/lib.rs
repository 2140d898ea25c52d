//! Hostile test plugin: sleeps for an hour, then reports what the clocks said. The host's clocks
//! are frozen and its timers already due, so the sleep returns at once and both readings are
//! zero: a plugin cannot wait out its deadline inside a host call.

use std::time::{Duration, Instant, SystemTime};

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-sleep", "sleeps for an hour")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs(3600));
        let slept = started.elapsed();
        let wall = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Ok(Output {
            spec_json: input.spec_json,
            warnings: vec![
                format!("slept {}ns", slept.as_nanos()),
                format!("wall clock {}s", wall.as_secs()),
            ],
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
