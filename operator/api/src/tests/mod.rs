//! Unit tests of the CRDs and types against PKO v2.9's CRDs and example manifests.

mod cel;
mod columns;
mod examples;
mod fidelity;
mod fresh;
mod markers;
mod structural;
mod support;
