//! The naming-policy plugin: see [`logic`].

mod logic;

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

struct NamingPolicy;

fn policy(config_json: &str) -> Result<logic::Policy, TransformError> {
    let config: logic::Config = pko_transform_sdk::parse_config(config_json)?;
    logic::policy(config).map_err(into_error)
}

fn into_error(error: logic::Error) -> TransformError {
    match error {
        logic::Error::InvalidConfig(message) => TransformError::InvalidConfig(message),
        logic::Error::Rejected(message) => TransformError::Rejected(message),
    }
}

impl Transformer for NamingPolicy {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "naming-policy",
            "prefixes resource names with the namespace, or rejects names not matching a pattern"
        )
    }

    fn validate_config(config_json: String) -> Result<(), TransformError> {
        policy(&config_json).map(|_| ())
    }

    fn transform(input: Program, config_json: String) -> Result<Output, TransformError> {
        let policy = policy(&config_json)?;
        let mut spec = input.spec()?;
        let warnings =
            logic::transform(&input.namespace, &mut spec, &policy).map_err(into_error)?;
        Output::new(spec, warnings)
    }
}

pko_transform_sdk::export_plugin!(NamingPolicy);
