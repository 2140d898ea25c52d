//! A hostile workspace agent (placeholder until the scenario lands).

/// Sizes the hostile agent sends.
#[derive(Clone, Debug)]
pub struct AgentScale {
    pub event_bytes: usize,
    pub line_bytes: usize,
    pub flood_bytes: usize,
}

impl AgentScale {
    pub const FULL: AgentScale = AgentScale {
        event_bytes: 300 << 20,
        line_bytes: 1 << 30,
        flood_bytes: 1 << 30,
    };
    pub const SHORT: AgentScale = AgentScale {
        event_bytes: 24 << 20,
        line_bytes: 40 << 20,
        flood_bytes: 64 << 20,
    };
}

/// The hostile-agent section (placeholder).
pub async fn section(
    _plane: &crate::ControlPlane,
    _scale: &super::Scale,
) -> Result<super::Section, crate::HarnessError> {
    Err(crate::HarnessError::Missing {
        what: "the hostile-agent scenario".into(),
    })
}
