//! The Program as a replica keeps it: metadata, status, and the spec as the JSON text the
//! apiserver sent.
//!
//! A typed `ProgramSpec` is a tree of maps: each small map allocates a whole B-tree node (eleven
//! slots), and a resource entry is several hundred bytes wide, so a one-resource Program costs
//! kilobytes in memory while its JSON is a few hundred bytes. The spec is read only to build an
//! artifact, once per generation (the cache serves the bytes after that), so the store keeps
//! the text and the build parses it. Everything the controllers read on every event (names,
//! generation, labels, status) stays typed.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::NamespaceResourceScope;
use pko_api::program::{Program, ProgramSpec, ProgramStatus};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Why a stored spec cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum StoredError {
    #[error("program spec does not match the Program schema: {0}")]
    Spec(#[source] serde_json::Error),
}

/// A Program, with its spec kept as JSON text (see the module docs).
#[derive(Clone, Debug, Deserialize)]
pub struct StoredProgram {
    /// Without `managedFields`: the apiserver mirrors the spec's nesting there, which would put
    /// a deep Program past serde_json's depth limit and fail the whole list
    /// (`pko_api::decode`).
    #[serde(default, deserialize_with = "pko_api::decode::object_meta")]
    pub metadata: ObjectMeta,
    /// The value under `program:`, exactly as received (absent: the empty spec).
    #[serde(default)]
    program: Option<Box<RawValue>>,
    #[serde(default)]
    pub status: Option<ProgramStatus>,
}

impl StoredProgram {
    /// The typed spec, parsed from the stored text.
    pub fn spec(&self) -> Result<ProgramSpec, StoredError> {
        match &self.program {
            Some(text) => serde_json::from_str(text.get()).map_err(StoredError::Spec),
            None => Ok(ProgramSpec::default()),
        }
    }

    /// The stored JSON text of the spec (`{}` when it has none).
    pub fn spec_json(&self) -> &str {
        self.program.as_deref().map_or("{}", RawValue::get)
    }

    /// The stored form of a typed Program (the offline renderer reads Programs from files).
    pub fn from_program(program: &Program) -> Result<Self, StoredError> {
        let text = serde_json::to_string(&program.program).map_err(StoredError::Spec)?;
        Ok(Self {
            metadata: program.metadata.clone(),
            program: Some(RawValue::from_string(text).map_err(StoredError::Spec)?),
            status: program.status.clone(),
        })
    }
}

impl Resource for StoredProgram {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        Program::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        Program::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        Program::version(dt)
    }
    fn api_version(dt: &()) -> Cow<'_, str> {
        Program::api_version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        Program::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use kube::api::WatchEvent;
    use serde_json::json;

    use super::*;

    fn object() -> serde_json::Value {
        json!({
            "apiVersion": "pulumi.com/v1", "kind": "Program",
            "metadata": {"name": "p", "namespace": "ns", "generation": 2, "uid": "u"},
            "program": {
                "configuration": {"size": {"type": "Number", "default": 3}},
                "resources": {"r": {"type": "random:index:RandomString", "properties": {"length": "${size}"}}},
                "outputs": {"value": "${r.result}"},
            },
            "status": {"observedGeneration": 1},
        })
    }

    #[test]
    fn a_watch_event_keeps_the_spec_as_text_and_reads_back_the_same_spec() {
        // The path kube's watcher takes: a whole watch line, the object inside an event.
        let line = serde_json::to_string(&json!({"type": "ADDED", "object": object()})).unwrap();
        let event: WatchEvent<StoredProgram> = serde_json::from_str(&line).unwrap();
        let WatchEvent::Added(stored) = event else {
            panic!("not an ADDED event: {event:?}")
        };
        let typed: Program = serde_json::from_value(object()).unwrap();
        assert_eq!(stored.spec().unwrap(), typed.program);
        assert_eq!(stored.metadata, typed.metadata);
        assert_eq!(stored.status, typed.status);
        assert!(stored.spec_json().contains("random:index:RandomString"));
    }

    #[test]
    fn a_list_and_a_missing_spec_read_too() {
        let mut bare = object();
        bare.as_object_mut().unwrap().remove("program");
        let list = json!({"apiVersion": "v1", "kind": "ProgramList", "metadata": {}, "items": [object(), bare]});
        let list: kube::core::ObjectList<StoredProgram> =
            serde_json::from_str(&list.to_string()).unwrap();
        assert_eq!(list.items.len(), 2);
        assert_eq!(list.items[1].spec().unwrap(), ProgramSpec::default());
    }

    #[test]
    fn a_spec_the_schema_refuses_is_an_error_at_build_time() {
        let mut bad = object();
        bad["program"]["resources"] = json!(["not", "a", "map"]);
        let stored: StoredProgram = serde_json::from_str(&bad.to_string()).unwrap();
        let err = stored.spec().unwrap_err();
        assert!(err.to_string().contains("Program schema"), "{err}");
    }

    #[test]
    fn a_list_with_a_program_nested_past_serde_jsons_limit_decodes() {
        // What the apiserver sends for a Program 120 deep: managedFields mirror the spec one
        // level deeper (`f:program` then `f:a` ...).
        let depth = 120;
        let spec = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
        let fields = format!(
            "{}{{}}{}",
            r#"{"f:a":"#.repeat(depth + 1),
            "}".repeat(depth + 1)
        );
        let item = format!(
            r#"{{"apiVersion":"pulumi.com/v1","kind":"Program","metadata":{{"name":"deep",
            "namespace":"ns","uid":"u","resourceVersion":"7","generation":1,"managedFields":[
            {{"manager":"kubectl","operation":"Apply","fieldsType":"FieldsV1","fieldsV1":{fields}}}]}},
            "program":{{"variables":{spec}}}}}"#
        );
        let list = format!(
            r#"{{"apiVersion":"v1","kind":"ProgramList","metadata":{{}},"items":[{item}]}}"#
        );
        assert!(
            serde_json::from_str::<serde_json::Value>(&list).is_err(),
            "not past the limit"
        );
        let list: kube::core::ObjectList<StoredProgram> = serde_json::from_str(&list).unwrap();
        assert_eq!(list.items[0].metadata.name.as_deref(), Some("deep"));
        let event = format!(r#"{{"type":"MODIFIED","object":{item}}}"#);
        let event: WatchEvent<StoredProgram> = serde_json::from_str(&event).unwrap();
        assert!(matches!(event, WatchEvent::Modified(_)));
    }

    #[test]
    fn a_typed_program_round_trips() {
        let typed: Program = serde_json::from_value(object()).unwrap();
        let stored = StoredProgram::from_program(&typed).unwrap();
        assert_eq!(stored.spec().unwrap(), typed.program);
    }
}
