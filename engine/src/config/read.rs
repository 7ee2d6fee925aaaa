//! Typed readers of a JSON document's fields, for the plugin configuration.
//!
//! Each reader takes a field's path and value and gives the value, or names
//! what is wrong (`path: invalid type: string "30", expected u32`: what was
//! found and what is accepted) and gives nothing, so the field keeps its
//! default and the rest of the document is still read: every problem is
//! reported at once. The words are serde's, which operators and tests know.
//! Read by hand rather than derived: serde's derived deserializers for the
//! configuration made the Wasm module 29 KB larger, and every VM of every
//! worker compiles the module (docs/benchmarks.md, "A smaller module"). The
//! readers run once per configuration, so each is kept out of line: one copy
//! in the module rather than one per field.

use serde_json::{Map, Value};

/// The path of `key` in the object at `path` (`key` itself at the top).
#[inline(never)]
pub(crate) fn at(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// `value`, unless it is null: an optional field given null is absent.
pub(crate) fn unless_null(value: &Value) -> Option<&Value> {
    (!value.is_null()).then_some(value)
}

/// Puts `value` in `slot` if there is one (a field that was refused keeps
/// its default).
pub(crate) fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *slot = value;
    }
}

/// What reads one field of an object: given its key, its path, its value
/// and the problems so far.
pub(crate) type ReadField<'a> = &'a mut dyn FnMut(&str, &str, &Value, &mut Vec<String>);

/// Reads the object at `path` a field at a time: `read_field(key, its
/// path, its value, problems)` for each field in `known`; each other field
/// is named as unknown. `None` when `value` is not an object (`what` names
/// what is expected: `struct Policy`). One copy of this loop for every
/// struct: the closure holds only what is the struct's own.
#[inline(never)]
pub(crate) fn fields(
    path: &str,
    value: &Value,
    what: &str,
    known: &[&str],
    problems: &mut Vec<String>,
    read_field: ReadField<'_>,
) -> Option<()> {
    let fields = object(path, value, what, problems)?;
    for (key, value) in fields {
        let at = at(path, key);
        if known.contains(&key.as_str()) {
            read_field(key, &at, value, problems);
        } else {
            unknown(&at, key, known, problems);
        }
    }
    Some(())
}

/// An object (`what` names it in a refusal: `struct Policy`).
#[inline(never)]
fn object<'v>(
    path: &str,
    value: &'v Value,
    what: &str,
    problems: &mut Vec<String>,
) -> Option<&'v Map<String, Value>> {
    match value {
        Value::Object(fields) => Some(fields),
        _ => wrong_type(path, value, what, problems),
    }
}

/// An array's items.
#[inline(never)]
pub(crate) fn array<'v>(
    path: &str,
    value: &'v Value,
    problems: &mut Vec<String>,
) -> Option<&'v [Value]> {
    match value {
        Value::Array(items) => Some(items),
        _ => wrong_type(path, value, "a sequence", problems),
    }
}

/// A string.
#[inline(never)]
pub(crate) fn string(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        _ => wrong_type(path, value, "a string", problems),
    }
}

/// An array of strings; an item that is not one is named and left out.
#[inline(never)]
pub(crate) fn strings(
    path: &str,
    value: &Value,
    problems: &mut Vec<String>,
) -> Option<Vec<String>> {
    let items = array(path, value, problems)?;
    let mut kept = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        kept.extend(string(&format!("{path}[{i}]"), item, problems));
    }
    Some(kept)
}

/// `true` or `false`.
#[inline(never)]
pub(crate) fn boolean(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<bool> {
    match value {
        Value::Bool(b) => Some(*b),
        _ => wrong_type(path, value, "a boolean", problems),
    }
}

/// A whole number that fits a `u32`.
#[inline(never)]
pub(crate) fn u32(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<u32> {
    unsigned(path, value, u64::from(u32::MAX), "u32", problems).and_then(|n| u32::try_from(n).ok())
}

/// A whole number that fits a `u16`.
#[inline(never)]
pub(crate) fn u16(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<u16> {
    unsigned(path, value, u64::from(u16::MAX), "u16", problems).and_then(|n| u16::try_from(n).ok())
}

/// A whole number that fits a `u64`.
#[inline(never)]
pub(crate) fn u64(path: &str, value: &Value, problems: &mut Vec<String>) -> Option<u64> {
    unsigned(path, value, u64::MAX, "u64", problems)
}

/// A whole number in `0..=max`; `type_name` names the range in a refusal.
#[inline(never)]
fn unsigned(
    path: &str,
    value: &Value,
    max: u64,
    type_name: &str,
    problems: &mut Vec<String>,
) -> Option<u64> {
    let Value::Number(n) = value else {
        return wrong_type(path, value, type_name, problems);
    };
    match (n.as_u64(), n.as_i64()) {
        (Some(n), _) if n <= max => Some(n),
        // Negative or too large: of the right type, out of its range.
        (Some(_), _) | (None, Some(_)) => {
            problems.push(format!(
                "{path}: invalid value: {}, expected {type_name}",
                found(value)
            ));
            None
        }
        (None, None) => wrong_type(path, value, type_name, problems),
    }
}

/// One of `variants`, by name.
pub(crate) fn variant<T: Copy>(
    path: &str,
    value: &Value,
    variants: &[(&str, T)],
    problems: &mut Vec<String>,
) -> Option<T> {
    let names: Vec<&str> = variants.iter().map(|(name, _)| *name).collect();
    let chosen = choose(path, value, &names, problems)?;
    variants.get(chosen).map(|(_, v)| *v)
}

/// Which of `names` the value is (one copy of the work for every enum).
#[inline(never)]
fn choose(path: &str, value: &Value, names: &[&str], problems: &mut Vec<String>) -> Option<usize> {
    let Value::String(given) = value else {
        return wrong_type(path, value, &one_of(names), problems);
    };
    let chosen = names.iter().position(|name| name == given);
    if chosen.is_none() {
        problems.push(format!(
            "{path}: unknown variant `{given}`, expected {}",
            one_of(names)
        ));
    }
    chosen
}

/// Names the field `key` (at `path`) that the object does not have, with
/// the ones it has (`fields`).
#[inline(never)]
pub(crate) fn unknown(path: &str, key: &str, fields: &[&str], problems: &mut Vec<String>) {
    problems.push(format!(
        "{path}: unknown field `{key}`, expected {}",
        one_of(fields)
    ));
}

/// Names the required `field` the object at `path` lacks.
#[inline(never)]
pub(crate) fn missing(path: &str, field: &str, problems: &mut Vec<String>) {
    problems.push(format!("{path}: missing field `{field}`"));
}

/// A value of the wrong type: names it and what is accepted.
fn wrong_type<T>(
    path: &str,
    value: &Value,
    expected: &str,
    problems: &mut Vec<String>,
) -> Option<T> {
    problems.push(invalid_type(path, value, expected));
    None
}

/// The refusal of `value` at `path`, of the wrong type.
#[inline(never)]
fn invalid_type(path: &str, value: &Value, expected: &str) -> String {
    format!(
        "{path}: invalid type: {}, expected {expected}",
        found(value)
    )
}

/// What a value is, as a refusal shows it.
#[inline(never)]
fn found(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Number(n) if n.is_f64() => format!("floating point `{n}`"),
        Value::Number(n) => format!("integer `{n}`"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "sequence".to_owned(),
        Value::Object(_) => "map".to_owned(),
    }
}

/// `` `a` ``, `` `a` or `b` ``, or `` one of `a`, `b`, `c` ``.
#[inline(never)]
fn one_of(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [one] => one.clone(),
        [a, b] => format!("{a} or {b}"),
        _ => format!("one of {}", quoted.join(", ")),
    }
}
