//! Checking a JSON document against a serde type field by field, so that
//! every unknown field and every value of the wrong type is reported with its
//! path (serde alone stops at the first). Used by [`super::Config::parse`].

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// Tries a candidate value in its place in the document: `Some(error)` when
/// the document would be refused for it.
type Probe<'a> = &'a dyn Fn(&Value) -> Option<String>;

/// Why `T` refuses `candidate`.
pub(super) fn refusal<T: DeserializeOwned>(candidate: &Value) -> Option<String> {
    T::deserialize(candidate).err().map(|e| e.to_string())
}

/// `error`, unless it is a `missing field` one: an object built up field by
/// field lacks the fields still to come.
fn but_missing(error: Option<String>) -> Option<String> {
    error.filter(|e| !e.starts_with("missing field"))
}

/// The part of `value` (at `path`) that `probe` accepts; what it leaves out is
/// pushed to `problems`.
fn narrow(
    path: &str,
    value: &Value,
    probe: Probe<'_>,
    problems: &mut Vec<String>,
) -> Option<Value> {
    let Some(error) = probe(value) else {
        return Some(value.clone());
    };
    match value {
        Value::Object(fields) => narrow_object(path, fields, Map::new(), probe, problems),
        Value::Array(items) => {
            if let Some(error) = but_missing(probe(&Value::Array(vec![]))) {
                problems.push(problem(path, &error));
                return None;
            }
            let mut kept: Vec<Value> = vec![];
            for (i, item) in items.iter().enumerate() {
                let at = |candidate: &Value| {
                    let mut trial = kept.clone();
                    trial.push(candidate.clone());
                    probe(&Value::Array(trial))
                };
                if let Some(item) = narrow(&format!("{path}[{i}]"), item, &at, problems) {
                    kept.push(item);
                }
            }
            Some(Value::Array(kept))
        }
        _ => {
            problems.push(problem(path, &error));
            None
        }
    }
}

/// [`narrow`] for an object, starting from the fields in `seed`.
pub(super) fn narrow_object(
    path: &str,
    fields: &Map<String, Value>,
    seed: Map<String, Value>,
    probe: Probe<'_>,
    problems: &mut Vec<String>,
) -> Option<Value> {
    if let Some(error) = but_missing(probe(&Value::Object(seed.clone()))) {
        // Not an object where one is expected, or an unknown object field.
        problems.push(problem(path, &error));
        return None;
    }
    // The top level starts complete (see `shape`); below it, an object is
    // complete only once all its fields are in.
    let top = path.is_empty();
    let mut kept = seed;
    for (key, value) in fields {
        let at = |candidate: &Value| {
            let mut trial = kept.clone();
            trial.insert(key.clone(), candidate.clone());
            let error = probe(&Value::Object(trial));
            if top {
                error
            } else {
                but_missing(error)
            }
        };
        let sub = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        if let Some(value) = narrow(&sub, value, &at, problems) {
            kept.insert(key.clone(), value);
        }
    }
    let kept = Value::Object(kept);
    if let Some(error) = probe(&kept) {
        // A required field is missing.
        problems.push(problem(path, &error));
        return None;
    }
    Some(kept)
}

/// One problem line: the field's path and what serde said (which names the
/// value and what is accepted), but never the token's value.
fn problem(path: &str, error: &str) -> String {
    if path.is_empty() {
        return error.to_owned();
    }
    if path == "token" {
        return "token: must be a string (value not shown)".to_owned();
    }
    format!("{path}: {error}")
}

/// A JSON value's kind, for messages.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
