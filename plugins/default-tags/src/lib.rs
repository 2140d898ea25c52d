//! The default-tags plugin: see [`logic`].

mod logic;

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct DefaultTags;

fn config(config_json: &str) -> Result<logic::Config, TransformError> {
    let config: logic::Config = pko_transform_sdk::parse_config(config_json)?;
    logic::check_config(&config).map_err(into_error)?;
    Ok(config)
}

fn into_error(error: logic::Error) -> TransformError {
    match error {
        logic::Error::InvalidConfig(message) => TransformError::InvalidConfig(message),
    }
}

impl Transformer for DefaultTags {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "default-tags",
            "merges configured tags and Program labels into resource tags, by type prefix"
        )
    }

    fn validate_config(config_json: String) -> Result<(), TransformError> {
        config(&config_json).map(|_| ())
    }

    fn transform(input: Program, config_json: String) -> Result<Output, TransformError> {
        let config = config(&config_json)?;
        let mut spec = input.spec()?;
        let warnings = logic::transform(&input.namespace, &input.label_map(), &mut spec, &config);
        Output::new(spec, warnings)
    }
}

pko_transform_sdk::export_plugin!(DefaultTags);
