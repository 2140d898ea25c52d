//! The resource-allowlist plugin: see [`logic`].

mod logic;

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct ResourceAllowlist;

fn config(config_json: &str) -> Result<logic::Config, TransformError> {
    let config: logic::Config = pko_transform_sdk::parse_config(config_json)?;
    logic::check_config(&config).map_err(into_error)?;
    Ok(config)
}

fn into_error(error: logic::Error) -> TransformError {
    match error {
        logic::Error::InvalidConfig(message) => TransformError::InvalidConfig(message),
        logic::Error::Rejected(message) => TransformError::Rejected(message),
    }
}

impl Transformer for ResourceAllowlist {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "resource-allowlist",
            "rejects Programs using resource types outside an allowlist"
        )
    }

    fn validate_config(config_json: String) -> Result<(), TransformError> {
        config(&config_json).map(|_| ())
    }

    fn transform(input: Program, config_json: String) -> Result<Output, TransformError> {
        let config = config(&config_json)?;
        let spec = input.spec()?;
        logic::transform(&spec, &config).map_err(into_error)?;
        Output::new(spec, Vec::new())
    }
}

pko_transform_sdk::export_plugin!(ResourceAllowlist);
