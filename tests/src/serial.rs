//! Tests that need the machine to themselves, in a test binary whose tests run on several
//! threads.
//!
//! Every integration test holds [`shared`] (or [`shared_blocking`]) while it runs; a test that
//! measures or loads the whole machine (a chaos scenario) holds [`alone`] instead, which waits
//! for the running tests to end and keeps new ones waiting until it ends. The lock is fair:
//! a waiting [`alone`] is served before tests that ask after it, so it is never starved.

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static MACHINE: RwLock<()> = RwLock::const_new(());

/// Held by an ordinary test for its whole run: any number of them at once.
pub async fn shared() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().await
}

/// [`shared`] for a test without a runtime (`#[test]`); must not be called inside one.
pub fn shared_blocking() -> RwLockReadGuard<'static, ()> {
    MACHINE.blocking_read()
}

/// Held by a test that must run with no other test at the same time.
pub async fn alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().await
}
