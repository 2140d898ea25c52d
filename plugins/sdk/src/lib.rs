//! Guest-side SDK for pko-rs transform plugins.
//!
//! A plugin is a WebAssembly component exporting `pko:transform/transformer@0.1.0` (see
//! `wit/transform.wit`). This crate generates the bindings once and adds small helpers, so a
//! plugin crate only implements [`Transformer`] and calls [`export_plugin!`]:
//!
//! ```ignore
//! use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};
//!
//! struct Identity;
//!
//! impl Transformer for Identity {
//!     fn info() -> PluginInfo { pko_transform_sdk::info("identity", "returns the Program unchanged") }
//!     fn validate_config(_config: String) -> Result<(), TransformError> { Ok(()) }
//!     fn transform(input: Program, _config: String) -> Result<Output, TransformError> {
//!         Ok(Output { spec_json: input.spec_json, warnings: vec![] })
//!     }
//! }
//!
//! pko_transform_sdk::export_plugin!(Identity);
//! ```
//!
//! Build with `cargo build --release --target wasm32-wasip2`; the `.wasm` file is a component.

// The generated export macro names this crate by its external name, also from inside it.
extern crate self as pko_transform_sdk;

#[doc(hidden)]
pub use wit_bindgen;

wit_bindgen::generate!({
    world: "plugin",
    // The WIT is vendored (a copy of wit/transform.wit, kept equal by a test), so the crate
    // builds as a dependency from outside this repository.
    path: "wit",
    pub_export_macro: true,
    export_macro_name: "export_plugin",
    default_bindings_module: "pko_transform_sdk",
    runtime_path: "pko_transform_sdk::wit_bindgen::rt",
});

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

pub use exports::pko::transform::transformer::Guest as Transformer;
pub use pko::transform::log::Level;
pub use pko::transform::types::{Output, PluginInfo, Program, TransformError};

/// Write one line to the operator's log.
pub fn log(level: Level, message: &str) {
    pko::transform::log::log(level, message);
}

/// [`PluginInfo`] with this crate's caller's package version.
#[macro_export]
macro_rules! info {
    ($name:expr, $description:expr) => {
        $crate::PluginInfo {
            name: ::std::string::String::from($name),
            version: ::std::string::String::from(env!("CARGO_PKG_VERSION")),
            description: ::std::string::String::from($description),
        }
    };
}

/// Parses a configuration: `null` (no configuration given) becomes `T::default()` through
/// `Option`, anything else must deserialize as `T`.
pub fn parse_config<T: DeserializeOwned + Default>(config_json: &str) -> Result<T, TransformError> {
    let value: Value = serde_json::from_str(config_json)
        .map_err(|e| TransformError::InvalidConfig(format!("configuration is not JSON: {e}")))?;
    if value.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(value).map_err(|e| TransformError::InvalidConfig(e.to_string()))
}

impl Program {
    /// The `program` field as a JSON object (an empty one when the Program has no body).
    pub fn spec(&self) -> Result<Map<String, Value>, TransformError> {
        match serde_json::from_str(&self.spec_json) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(Value::Null) => Ok(Map::new()),
            Ok(_) => Err(TransformError::Internal(
                "the host sent a spec that is not a JSON object".into(),
            )),
            Err(e) => Err(TransformError::Internal(format!(
                "the host sent a spec that is not JSON: {e}"
            ))),
        }
    }

    /// The Program's labels as a map.
    pub fn label_map(&self) -> BTreeMap<String, String> {
        self.labels.iter().cloned().collect()
    }
}

impl Output {
    /// An output carrying `spec` and `warnings`.
    pub fn new(spec: Map<String, Value>, warnings: Vec<String>) -> Result<Self, TransformError> {
        let spec_json = serde_json::to_string(&Value::Object(spec))
            .map_err(|e| TransformError::Internal(format!("cannot encode the spec: {e}")))?;
        Ok(Self {
            spec_json,
            warnings,
        })
    }
}
