//! Hostile test plugin: imports an interface no plugin is granted (`hostile:secrets/store`), so
//! the host refuses it when it loads, naming the import.

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

wit_bindgen::generate!({
    inline: r#"
        package hostile:secrets@0.1.0;

        interface store {
            get: func(key: string) -> string;
        }

        world secrets {
            import store;
        }
    "#,
    world: "secrets",
});

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!(
            "hostile-forbidden-import",
            "imports hostile:secrets/store, which no plugin is granted"
        )
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        Ok(Output {
            spec_json: input.spec_json,
            warnings: vec![hostile::secrets::store::get("token")],
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
