//! Git credentials that both ends compute: the operator to list a branch's refs, the workspace
//! agent to check a revision out. Kept apart from both so the static agent links no more of it
//! than this (ring is already there through rustls).

pub mod github_app;
