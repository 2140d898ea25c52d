//! `metav1.Condition` lists: set one condition, keeping its transition time when its status
//! does not change, and compare lists without their timestamps (status is written only when
//! something changed).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Longest condition message written from an error (the apiserver's can be long).
pub const MESSAGE_LIMIT: usize = 1000;

/// Sets (or adds) condition `type_`.
pub fn set(
    list: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" };
    set_status(list, type_, status, reason, message, generation);
}

/// Sets (or adds) condition `type_` with `status` `True`, `False` or `Unknown`.
pub fn set_status(
    list: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    let now = Time(Timestamp::now());
    match list.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = now;
            }
            c.status = status.into();
            c.reason = reason.into();
            c.message = message.into();
            c.observed_generation = generation;
        }
        None => list.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: generation,
            last_transition_time: now,
        }),
    }
}

/// Removes condition `type_`.
pub fn remove(list: &mut Vec<Condition>, type_: &str) {
    list.retain(|c| c.type_ != type_);
}

pub fn get<'a>(list: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    list.iter().find(|c| c.type_ == type_)
}

pub fn is_true(list: &[Condition], type_: &str) -> bool {
    get(list, type_).is_some_and(|c| c.status == "True")
}

/// Equal except for transition times.
pub fn same(a: &[Condition], b: &[Condition]) -> bool {
    let key = |c: &Condition| {
        (
            c.type_.clone(),
            c.status.clone(),
            c.reason.clone(),
            c.message.clone(),
            c.observed_generation,
        )
    };
    let mut a: Vec<_> = a.iter().map(key).collect();
    let mut b: Vec<_> = b.iter().map(key).collect();
    a.sort();
    b.sort();
    a == b
}

pub use pko_api::text::truncate;
