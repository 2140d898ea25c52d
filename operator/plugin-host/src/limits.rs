//! Per-call limits: safe defaults, per-plugin overrides, operator-wide ceilings.

use std::time::Duration;

/// What one plugin call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Wasm fuel (roughly one unit per instruction): deterministic, so a plugin that runs out
    /// does so on every replica.
    pub fuel: u64,
    /// Wall-clock budget, enforced by epoch interruption and by a timeout around the call.
    pub timeout: Duration,
    /// Linear memory of the instance, in bytes.
    pub memory_bytes: u64,
    /// Size of the returned spec plus warnings, in bytes.
    pub output_bytes: u64,
}

impl Limits {
    /// The defaults: enough for a Program near etcd's size limit, small enough that a runaway
    /// plugin costs little.
    pub const DEFAULT: Limits = Limits {
        fuel: 2_000_000_000,
        timeout: Duration::from_secs(2),
        memory_bytes: 64 << 20,
        output_bytes: 4 << 20,
    };

    /// The highest values a plugin may ask for.
    pub const CEILING: Limits = Limits {
        fuel: 50_000_000_000,
        timeout: Duration::from_secs(30),
        memory_bytes: 512 << 20,
        output_bytes: 16 << 20,
    };

    /// `self` with each overridden field replaced, clamped to `ceiling`.
    pub fn with(self, overrides: &LimitOverrides, ceiling: &Limits) -> Limits {
        Limits {
            fuel: overrides.fuel.unwrap_or(self.fuel).min(ceiling.fuel),
            timeout: overrides
                .timeout
                .unwrap_or(self.timeout)
                .min(ceiling.timeout),
            memory_bytes: overrides
                .memory_bytes
                .unwrap_or(self.memory_bytes)
                .min(ceiling.memory_bytes),
            output_bytes: overrides
                .output_bytes
                .unwrap_or(self.output_bytes)
                .min(ceiling.output_bytes),
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Per-plugin overrides (from the transform object); `None` keeps the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct LimitOverrides {
    pub fuel: Option<u64>,
    pub timeout: Option<Duration>,
    pub memory_bytes: Option<u64>,
    pub output_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_are_clamped_to_the_ceiling() {
        let ceiling = Limits {
            fuel: 10,
            timeout: Duration::from_secs(1),
            memory_bytes: 100,
            output_bytes: 100,
        };
        let limits = Limits::DEFAULT.with(
            &LimitOverrides {
                fuel: Some(5),
                timeout: Some(Duration::from_secs(9)),
                memory_bytes: None,
                output_bytes: Some(50),
            },
            &ceiling,
        );
        assert_eq!(limits.fuel, 5);
        assert_eq!(limits.timeout, Duration::from_secs(1));
        assert_eq!(limits.memory_bytes, 100);
        assert_eq!(limits.output_bytes, 50);
    }
}
