//! Hostile test plugin: keeps state in globals (a counter, a static buffer, a heap value
//! leaked on purpose) and reports what it found, so a test can check that every call starts
//! from the module's initial state.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use pko_transform_sdk::{Output, PluginInfo, Program, TransformError, Transformer};

static CALLS: AtomicU64 = AtomicU64::new(0);
static BUFFER: Mutex<[u8; 64 * 1024]> = Mutex::new([0; 64 * 1024]);
static LEAKED: Mutex<Option<&'static str>> = Mutex::new(None);

struct Hostile;

impl Transformer for Hostile {
    fn info() -> PluginInfo {
        pko_transform_sdk::info!("hostile-stateful", "remembers what earlier calls did")
    }

    fn validate_config(_config_json: String) -> Result<(), TransformError> {
        CALLS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn transform(input: Program, _config_json: String) -> Result<Output, TransformError> {
        let calls = CALLS.fetch_add(1, Ordering::SeqCst);
        let mut buffer = BUFFER.lock().unwrap_or_else(|e| e.into_inner());
        let dirty = buffer.iter().filter(|b| **b != 0).count();
        buffer.fill(0xA5);
        let mut leaked = LEAKED.lock().unwrap_or_else(|e| e.into_inner());
        let previous = leaked.unwrap_or("none");
        let warnings = vec![
            format!("calls before: {calls}"),
            format!("dirty buffer bytes: {dirty}"),
            format!("leaked by an earlier call: {previous}"),
        ];
        *leaked = Some(Box::leak(input.name.into_boxed_str()));
        Ok(Output {
            spec_json: input.spec_json,
            warnings,
        })
    }
}

pko_transform_sdk::export_plugin!(Hostile);
