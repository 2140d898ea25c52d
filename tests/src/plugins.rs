//! The transform plugins built by `make plugins`, for tests and benchmarks.

use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::HarnessError;

/// Where `make plugins` writes the components: `$PKO_PLUGINS_DIR` (set by the Makefile), else
/// the Makefile's default.
pub fn plugins_dir() -> PathBuf {
    match std::env::var_os("PKO_PLUGINS_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/pko-rs/plugins-target/wasm32-wasip2/release")
        }
    }
}

/// A built component.
#[derive(Debug, Clone)]
pub struct PluginModule {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
    /// Lowercase hex sha256 of `bytes`.
    pub sha256: String,
}

/// The component `<name>.wasm` (crate name with `_`, e.g. `default_tags`).
pub fn module(name: &str) -> Result<PluginModule, HarnessError> {
    let path = plugins_dir().join(format!("{name}.wasm"));
    let bytes = std::fs::read(&path).map_err(|e| HarnessError::Missing {
        what: format!(
            "plugin component {} ({e}): run `make plugins` (or set PKO_PLUGINS_DIR)",
            path.display()
        ),
    })?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    Ok(PluginModule {
        path,
        bytes,
        sha256,
    })
}

/// A precompiled-module folder shared by the operators of tests, so each module is compiled
/// once (debug builds compile slowly). Entries are keyed by module digest and engine build, so
/// reusing the folder across runs is safe: it is what `--plugin-cache-dir` is for.
pub fn shared_cache_dir() -> PathBuf {
    std::env::temp_dir().join("pko-rs-plugin-cache")
}

/// Components whose compile is costly by construction, for the compile bounds: valid
/// components holding one core module of `functions` functions, each a chain of `units`
/// dependent additions to a local. Cranelift keeps a function's whole IR while it compiles
/// it, so memory grows with `units` (about 770 bytes each) and time with `functions × units`;
/// the module is about 7 bytes per unit. Neither exports the plugin interface: a host that
/// compiled one would then refuse it as not a plugin.
pub mod costly {
    use super::PluginModule;
    use sha2::{Digest, Sha256};

    /// One function of `units` additions: what its compile needs grows with `units`.
    pub fn memory_bomb(units: usize) -> PluginModule {
        component(1, units, "memory-bomb")
    }

    /// Many functions of moderate size: memory stays low, time grows with the total.
    pub fn slow(functions: usize, units: usize) -> PluginModule {
        component(functions, units, "slow-compile")
    }

    fn component(functions: usize, units: usize, name: &str) -> PluginModule {
        // local.get 0; i32.const 1; i32.add; local.set 0
        const UNIT: [u8; 7] = [0x20, 0x00, 0x41, 0x01, 0x6a, 0x21, 0x00];
        let mut body = vec![0x01, 0x01, 0x7f]; // one group of one i32 local
        for _ in 0..units {
            body.extend_from_slice(&UNIT);
        }
        body.push(0x0b);
        let types = section(1, &[&[0x01, 0x60, 0x00, 0x00]]);
        let mut decls = leb(functions);
        decls.extend(std::iter::repeat_n(0u8, functions));
        let funcs = section(3, &[&decls]);
        let mut code = leb(functions);
        let sized = [leb(body.len()), body].concat();
        for _ in 0..functions {
            code.extend_from_slice(&sized);
        }
        let code = section(10, &[&code]);
        let core = [b"\0asm\x01\0\0\0".as_slice(), &types, &funcs, &code].concat();
        // A component (layer 1) whose only section is the core module.
        let bytes = [b"\0asm\x0d\0\x01\0".as_slice(), &section(1, &[&core])].concat();
        PluginModule {
            path: format!("{name}-{functions}x{units}.wasm").into(),
            sha256: hex::encode(Sha256::digest(&bytes)),
            bytes,
        }
    }

    fn section(id: u8, parts: &[&[u8]]) -> Vec<u8> {
        let body: Vec<u8> = parts.concat();
        [vec![id], leb(body.len()), body].concat()
    }

    fn leb(mut n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return out;
            }
            out.push(byte | 0x80);
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_components_are_what_wasmtime_parses() {
            // The same bytes as a hand-checked encoding of one function of one unit.
            let m = super::memory_bomb(1);
            assert_eq!(&m.bytes[..8], b"\0asm\x0d\0\x01\0");
            assert_eq!(m.bytes.len(), 8 + 2 + 8 + 6 + 4 + 15);
            assert!(super::slow(3, 10).bytes.len() > 3 * 70);
        }
    }
}
