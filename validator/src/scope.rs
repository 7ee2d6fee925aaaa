//! What the watches cover, and which services that lets the index judge.
//!
//! With `--namespace` or `--pod-selector` the validator does not see every pod.
//! A service whose members could include a pod it does not see must not be
//! judged: that pod's IP would read as destroyed (nobody the validator knows
//! holds it) while it serves. Such a service is **out of scope**: the index
//! treats it as unknown (a verdict for it follows the `unknown_service`
//! policy, allowed by default) and says why. A service is in scope when every
//! pod that can be its member is watched:
//!
//! - it has a selector (a service without one gets its EndpointSlices from a
//!   person or another controller, and they may name any pod), and
//! - with `--pod-selector`, its selector implies the pod selector: every pod
//!   the service selects matches it (`app=cart` implies `app in (cart,pay)`,
//!   not `tier=web`).
//!
//! Without a scope every service is in scope. Services in other namespaces
//! are not watched at all under `--namespace`, so they are unknown anyway.

use std::collections::BTreeMap;
use std::fmt;

/// A parsed label selector (`a=b,c!=d,e in (f,g),h notin (i),j,!k`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    text: String,
    requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Requirement {
    key: String,
    op: Op,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
}

impl Selector {
    /// Parses a label selector as `kubectl -l` takes it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text)? {
            requirements.push(requirement(part.trim())?);
        }
        if requirements.is_empty() {
            return Err("empty selector".into());
        }
        Ok(Self {
            text: text.trim().to_owned(),
            requirements,
        })
    }

    /// True when every label set matching `labels` exactly (a Service's
    /// equality selector) also matches this selector.
    fn implied_by(&self, labels: &BTreeMap<&str, &str>) -> bool {
        self.requirements.iter().all(|r| {
            let value = labels.get(r.key.as_str());
            match (&r.op, value) {
                (Op::In(values), Some(v)) => values.iter().any(|x| x == v),
                (Op::NotIn(values), Some(v)) => !values.iter().any(|x| x == v),
                (Op::Exists, Some(_)) => true,
                // A pod the service selects may or may not carry the key.
                (Op::DoesNotExist, _) | (_, None) => false,
            }
        })
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced parentheses".into());
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn requirement(part: &str) -> Result<Requirement, String> {
    let bad = |why: &str| Err(format!("{part:?}: {why}"));
    if part.is_empty() {
        return bad("empty requirement");
    }
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement {
            key: label_key(key.trim())?,
            op: Op::DoesNotExist,
        });
    }
    for (sep, negate) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((key, value)) = part.split_once(sep) {
            let value = label_value(value.trim())?;
            let key = label_key(key.trim())?;
            let op = if negate {
                Op::NotIn(vec![value])
            } else {
                Op::In(vec![value])
            };
            return Ok(Requirement { key, op });
        }
    }
    let words: Vec<&str> = part.splitn(2, char::is_whitespace).collect();
    match words.as_slice() {
        [key] => Ok(Requirement {
            key: label_key(key)?,
            op: Op::Exists,
        }),
        [key, rest] => {
            let rest = rest.trim();
            let (negate, set) = if let Some(set) = rest.strip_prefix("notin") {
                (true, set)
            } else if let Some(set) = rest.strip_prefix("in") {
                (false, set)
            } else {
                return bad("expected `in (...)`, `notin (...)`, `=`, `==` or `!=`");
            };
            let Some(inner) = set
                .trim()
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
            else {
                return bad("a set needs parentheses");
            };
            let values = inner
                .split(',')
                .map(|v| label_value(v.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            let key = label_key(key)?;
            Ok(Requirement {
                key,
                op: if negate {
                    Op::NotIn(values)
                } else {
                    Op::In(values)
                },
            })
        }
        _ => bad("empty requirement"),
    }
}

fn label_key(key: &str) -> Result<String, String> {
    let ok = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    if ok {
        Ok(key.to_owned())
    } else {
        Err(format!("{key:?} is not a label key"))
    }
}

fn label_value(value: &str) -> Result<String, String> {
    let ok = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(value.to_owned())
    } else {
        Err(format!("{value:?} is not a label value"))
    }
}

/// Which pods the validator watches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodScope {
    /// `--namespace`.
    pub namespace: Option<String>,
    /// `--pod-selector`.
    pub pod_selector: Option<Selector>,
}

impl PodScope {
    /// True when every pod is watched.
    pub fn is_whole_cluster(&self) -> bool {
        self.namespace.is_none() && self.pod_selector.is_none()
    }

    /// Why a service in `namespace` with `selector` (its `spec.selector`;
    /// `None` or empty when it has none) is out of scope, or `None` when the
    /// watches see every pod that can be its member.
    pub fn excludes<'a>(
        &self,
        namespace: &str,
        selector: Option<impl IntoIterator<Item = (&'a str, &'a str)>>,
    ) -> Option<String> {
        if self.is_whole_cluster() {
            return None;
        }
        if let Some(ns) = &self.namespace {
            if ns != namespace {
                return Some(format!(
                    "namespace {namespace} is not watched (--namespace {ns})"
                ));
            }
        }
        let labels: BTreeMap<&str, &str> = selector
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        if labels.is_empty() {
            return Some(
                "it has no selector: its EndpointSlices may list pods outside the watched \
                 scope, which the validator cannot see"
                    .to_owned(),
            );
        }
        match &self.pod_selector {
            Some(pods) if !pods.implied_by(&labels) => {
                let mut own: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                own.sort();
                Some(format!(
                    "its selector {} does not imply --pod-selector {pods:?}: it may select \
                     pods the validator does not watch",
                    own.join(","),
                    pods = pods.text
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(pairs: &[(&'static str, &'static str)]) -> Option<Vec<(&'static str, &'static str)>> {
        Some(pairs.to_vec())
    }

    fn scope(ns: Option<&str>, pods: Option<&str>) -> PodScope {
        PodScope {
            namespace: ns.map(Into::into),
            pod_selector: pods.map(|p| Selector::parse(p).unwrap()),
        }
    }

    #[test]
    fn selectors_parse_as_kubectl_takes_them() {
        for ok in [
            "app=cart",
            "app==cart,tier!=db",
            "app in (cart, pay),!canary",
            "env notin (dev),team",
            "example.com/app=x",
        ] {
            assert!(Selector::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "app in (a",
            "app in a",
            "a=b c",
            "app is x",
            "=x",
            "a=(b)",
        ] {
            assert!(Selector::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_a_scope_everything_is_in_scope() {
        let s = PodScope::default();
        assert_eq!(s.excludes("shop", None::<Vec<(&str, &str)>>), None);
        assert_eq!(s.excludes("shop", sel(&[])), None);
    }

    #[test]
    fn a_service_is_in_scope_when_its_selector_implies_the_pod_selector() {
        let s = scope(None, Some("app in (cart,pay)"));
        assert_eq!(s.excludes("shop", sel(&[("app", "cart")])), None);
        assert_eq!(s.excludes("shop", sel(&[("app", "pay"), ("v", "2")])), None);
        let why = s.excludes("shop", sel(&[("app", "web")])).unwrap();
        assert!(
            why.contains("app=web does not imply --pod-selector"),
            "{why}"
        );
        let s = scope(None, Some("tier=web,!canary"));
        assert!(s.excludes("shop", sel(&[("tier", "web")])).is_some());
        let s = scope(None, Some("team,env notin (dev),tier!=db"));
        assert_eq!(
            s.excludes(
                "shop",
                sel(&[("team", "a"), ("env", "prod"), ("tier", "web")])
            ),
            None
        );
        assert!(s
            .excludes(
                "shop",
                sel(&[("team", "a"), ("env", "dev"), ("tier", "web")])
            )
            .is_some());
        assert!(s
            .excludes("shop", sel(&[("team", "a"), ("env", "prod")]))
            .is_some());
    }

    #[test]
    fn under_any_scope_services_without_a_selector_are_out() {
        for s in [scope(Some("shop"), None), scope(None, Some("app=cart"))] {
            let why = s.excludes("shop", None::<Vec<(&str, &str)>>).unwrap();
            assert!(why.contains("no selector"), "{why}");
        }
        let ns = scope(Some("shop"), None);
        assert_eq!(ns.excludes("shop", sel(&[("app", "x")])), None);
        assert!(ns.excludes("other", sel(&[("app", "x")])).is_some());
    }
}
