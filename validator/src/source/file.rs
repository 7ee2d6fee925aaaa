//! The file source: Pods, Services and EndpointSlices from a YAML or JSON file,
//! or a directory of them, re-read when they change.
//!
//! A file may hold one object, several YAML documents, or a `kind: List` as
//! `kubectl get pods,services,endpointslices -A -o yaml` prints it. Every load
//! is fed to the index as a relist of each kind (`Init`, `InitApply`...,
//! `InitDone`), so objects removed from the file go away. A load that fails
//! keeps the last good state, logs the path and the reason, and counts an error
//! on every watch; the data then turns stale after `--max-staleness` unless the
//! file is fixed.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::index::Kind;
use crate::live::SharedIndex;

/// The demo sample built into the binary (`validator/samples/demo.yaml`).
pub const DEMO: &str = include_str!("../../samples/demo.yaml");

/// The name the embedded sample goes by in errors and logs.
const DEMO_PATH: &str = "<embedded samples/demo.yaml>";

/// Why a file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// What was read.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Not YAML (or JSON).
    #[error("{path}: document {doc} is not valid YAML/JSON: {source}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The document's position in the file, from 1.
        doc: usize,
        /// The parser's complaint.
        #[source]
        source: yaml_serde::Error,
    },
    /// A document, or a `List` item, that is not an object with a `kind`.
    #[error("{path}: document {doc}: {what}")]
    NotAnObject {
        /// The file.
        path: PathBuf,
        /// The document's position in the file, from 1.
        doc: usize,
        /// What is wrong.
        what: String,
    },
    /// An object of a kind the index reads, but not of its shape.
    #[error("{path}: document {doc}: {kind} {name:?} is malformed: {source}")]
    Object {
        /// The file.
        path: PathBuf,
        /// The document's position in the file, from 1.
        doc: usize,
        /// The object's kind.
        kind: String,
        /// Its name, if it has one.
        name: String,
        /// Why it does not fit.
        #[source]
        source: yaml_serde::Error,
    },
}

/// The objects of one load.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    /// Pods.
    pub pods: Vec<Pod>,
    /// Services.
    pub services: Vec<Service>,
    /// EndpointSlices.
    pub slices: Vec<EndpointSlice>,
    /// Objects of other kinds, ignored.
    pub ignored: usize,
}

impl Objects {
    fn extend(&mut self, other: Objects) {
        self.pods.extend(other.pods);
        self.services.extend(other.services);
        self.slices.extend(other.slices);
        self.ignored += other.ignored;
    }
}

/// Parses the text of one file; `path` only names it in errors.
pub fn parse(text: &str, path: &Path) -> Result<Objects, FileError> {
    let mut objects = Objects::default();
    for (i, document) in yaml_serde::Deserializer::from_str(text).enumerate() {
        let doc = i + 1;
        let value =
            yaml_serde::Value::deserialize(document).map_err(|source| FileError::Syntax {
                path: path.to_owned(),
                doc,
                source,
            })?;
        collect(value, path, doc, &mut objects)?;
    }
    Ok(objects)
}

fn collect(
    value: yaml_serde::Value,
    path: &Path,
    doc: usize,
    out: &mut Objects,
) -> Result<(), FileError> {
    let not_an_object = |what: &str| FileError::NotAnObject {
        path: path.to_owned(),
        doc,
        what: what.to_owned(),
    };
    if value.is_null() {
        return Ok(()); // an empty document, e.g. after a trailing `---`
    }
    let Some(map) = value.as_mapping() else {
        return Err(not_an_object("not a mapping"));
    };
    let Some(kind) = map.get("kind").and_then(|k| k.as_str()).map(str::to_owned) else {
        return Err(not_an_object("has no `kind`"));
    };
    if kind.ends_with("List") {
        let items = match map.get("items") {
            Some(yaml_serde::Value::Sequence(items)) => items.clone(),
            Some(yaml_serde::Value::Null) | None => Vec::new(),
            Some(_) => return Err(not_an_object("`items` of a List is not a sequence")),
        };
        for item in items {
            collect(item, path, doc, out)?;
        }
        return Ok(());
    }
    let name = map
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_owned();
    let malformed = |source| FileError::Object {
        path: path.to_owned(),
        doc,
        kind: kind.clone(),
        name: name.clone(),
        source,
    };
    match kind.as_str() {
        "Pod" => out
            .pods
            .push(yaml_serde::from_value(value).map_err(malformed)?),
        "Service" => out
            .services
            .push(yaml_serde::from_value(value).map_err(malformed)?),
        "EndpointSlice" => out
            .slices
            .push(yaml_serde::from_value(value).map_err(malformed)?),
        _ => out.ignored += 1,
    }
    Ok(())
}

/// The files a path stands for: itself, or the `.yaml`/`.yml`/`.json` files of
/// a directory (not recursive, hidden files skipped), sorted.
fn files(path: &Path) -> Result<Vec<PathBuf>, FileError> {
    let read_err = |source| FileError::Read {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if !meta.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let p = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        let wanted = matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        );
        if wanted && !hidden && p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Loads a file or directory.
pub fn load(path: &Path) -> Result<Objects, FileError> {
    let mut objects = Objects::default();
    for file in files(path)? {
        let text = std::fs::read_to_string(&file).map_err(|source| FileError::Read {
            path: file.clone(),
            source,
        })?;
        objects.extend(parse(&text, &file)?);
    }
    Ok(objects)
}

/// What a poll compares to notice a change: each file's size and mtime.
type Stamp = Vec<(PathBuf, u64, Option<SystemTime>)>;

fn stamp(path: &Path) -> Result<Stamp, FileError> {
    files(path)?
        .into_iter()
        .map(|f| {
            let meta = std::fs::metadata(&f).map_err(|source| FileError::Read {
                path: f.clone(),
                source,
            })?;
            Ok((f, meta.len(), meta.modified().ok()))
        })
        .collect()
}

/// Feeds one load to the index as a relist of every kind.
pub fn feed(shared: &SharedIndex, objects: Objects, now: SystemTime) {
    let Objects {
        pods,
        services,
        slices,
        ignored: _,
    } = objects;
    shared.relist_all(services, pods, slices, now);
}

fn heard_all(shared: &SharedIndex) {
    for kind in Kind::ALL {
        shared.heard(kind);
    }
}

fn error_all(shared: &SharedIndex) {
    for kind in Kind::ALL {
        shared.watch_error(kind);
    }
}

fn log_loaded(path: &Path, objects: &Objects) {
    tracing::info!(
        path = %path.display(),
        pods = objects.pods.len(),
        services = objects.services.len(),
        slices = objects.slices.len(),
        ignored = objects.ignored,
        "loaded objects"
    );
    if objects.pods.is_empty() && objects.services.is_empty() && objects.slices.is_empty() {
        // Served as a fresh index all the same (an empty cluster is one),
        // but far more often a wrong path, an empty dump or a wrong kind.
        tracing::warn!(
            path = %path.display(),
            ignored = objects.ignored,
            "no Pods, Services or EndpointSlices: the index is empty and every service unknown; \
             is this the right file (kubectl get pods,services,endpointslices -A -o yaml)?"
        );
    }
}

/// Feeds the embedded sample once, then keeps the data fresh: it never changes.
pub fn start_embedded(shared: SharedIndex) -> Result<JoinHandle<()>, FileError> {
    let objects = parse(DEMO, Path::new(DEMO_PATH))?;
    log_loaded(Path::new(DEMO_PATH), &objects);
    feed(&shared, objects, SystemTime::now());
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            heard_all(&shared);
        }
    }))
}

/// Loads `path` (failing if the first load fails), then polls it every `poll`
/// and reloads it when it changes.
pub fn start(
    path: PathBuf,
    poll: Duration,
    shared: SharedIndex,
) -> Result<JoinHandle<()>, FileError> {
    let mut last = stamp(&path)?;
    let objects = load(&path)?;
    log_loaded(&path, &objects);
    feed(&shared, objects, SystemTime::now());
    Ok(tokio::spawn(async move {
        // Whether the current content of the file is what the index shows.
        let mut current = true;
        let mut tick = tokio::time::interval(poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let path2 = path.clone();
            let last2 = last.clone();
            // File I/O off the runtime's worker threads.
            let outcome = tokio::task::spawn_blocking(move || poll_once(&path2, &last2)).await;
            match outcome {
                Ok(Poll::Unchanged) => {}
                Ok(Poll::Changed(new_stamp, Ok(objects))) => {
                    log_loaded(&path, &objects);
                    feed(&shared, objects, SystemTime::now());
                    last = new_stamp;
                    current = true;
                }
                Ok(Poll::Changed(new_stamp, Err(error))) => {
                    tracing::error!(path = %path.display(), %error, "cannot load the file; keeping the last good state");
                    error_all(&shared);
                    last = new_stamp;
                    current = false;
                }
                Ok(Poll::Gone(error)) => {
                    if current {
                        tracing::error!(path = %path.display(), %error, "cannot read the file; keeping the last good state");
                        error_all(&shared);
                    }
                    last = Vec::new();
                    current = false;
                }
                Err(join) => {
                    tracing::error!(path = %path.display(), error = %join, "file poll failed");
                    error_all(&shared);
                }
            }
            if current {
                heard_all(&shared);
            }
        }
    }))
}

enum Poll {
    Unchanged,
    Changed(Stamp, Result<Objects, FileError>),
    Gone(FileError),
}

fn poll_once(path: &Path, last: &Stamp) -> Poll {
    match stamp(path) {
        Ok(s) if s == *last => Poll::Unchanged,
        Ok(s) => Poll::Changed(s, load(path)),
        Err(e) => Poll::Gone(e),
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::index::{Index, IndexConfig};

    #[test]
    fn the_demo_sample_parses_and_has_the_cases_it_promises() {
        let objects = parse(DEMO, Path::new("demo.yaml")).unwrap();
        assert!(objects.pods.len() >= 5);
        assert!(objects.services.len() >= 2);
        assert!(objects.slices.len() >= 2);
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        feed(&shared, objects, SystemTime::now());
        let index = shared.read();
        assert!(index.synced());
        let stats = index.stats();
        assert!(stats.skipped.is_empty(), "{:?}", stats.skipped);
        let snapshot = index.snapshot(Default::default());
        let pods = || snapshot.records.iter().flat_map(|r| &r.pods);
        assert!(pods().any(|p| p.terminating), "a terminating pod");
        assert!(pods().any(|p| p.host_network), "a hostNetwork pod");
        assert!(
            snapshot.records.iter().any(|r| r.pods.len() == 2),
            "a recycled IP held by two pods"
        );
    }

    #[test]
    fn lists_multiple_documents_and_json_all_load() {
        let list = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata: {name: a, namespace: x, uid: u-a}
  status: {podIPs: [{ip: 10.3.0.1}]}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: c, namespace: x}
---
apiVersion: v1
kind: Service
metadata: {name: s, namespace: x}
spec: {selector: {app: a}}
---
"#;
        let o = parse(list, Path::new("list.yaml")).unwrap();
        assert_eq!((o.pods.len(), o.services.len(), o.ignored), (1, 1, 1));
        let json = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
            "metadata":{"name":"s-1","namespace":"x","labels":{"kubernetes.io/service-name":"s"}},
            "addressType":"IPv4","endpoints":[{"addresses":["10.3.0.1"]}]}"#;
        let o = parse(json, Path::new("slice.json")).unwrap();
        assert_eq!(o.slices.len(), 1);
    }

    #[test]
    fn malformed_files_say_where_and_why() {
        let cases = [
            ("a: [", "not valid YAML"),
            ("- 1\n- 2", "not a mapping"),
            ("metadata: {}", "has no `kind`"),
            (
                "kind: Pod\nmetadata: {name: p}\nstatus: {podIPs: 7}",
                "Pod \"p\" is malformed",
            ),
        ];
        for (text, expected) in cases {
            let err = parse(text, Path::new("/tmp/bad.yaml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("/tmp/bad.yaml"), "{err}");
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "staleguard-file-test-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn pod_yaml(name: &str, ip: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, uid: u-{name}}}\nstatus: {{phase: Running, podIPs: [{{ip: {ip}}}]}}\n"
        )
    }

    const EMPTY_KINDS: &str = "---\nkind: List\nitems: []\n";

    async fn wait_for(shared: &SharedIndex, what: &str, check: impl Fn(&Index) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !check(&shared.read()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_changed_file_is_reloaded_and_a_broken_one_keeps_the_last_good_state() {
        let dir = temp_dir("reload");
        let file = dir.join("objects.yaml");
        std::fs::write(
            &file,
            format!("{}{}", pod_yaml("a", "10.4.0.1"), pod_yaml("b", "10.4.0.2")),
        )
        .unwrap();
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        let task = start(file.clone(), Duration::from_millis(20), shared.clone()).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(shared.read().record(ip("10.4.0.2")).is_some());
        assert!(shared.ready());

        // b removed, c added: a relist, so b goes away.
        std::fs::write(
            &file,
            format!(
                "{}{}{EMPTY_KINDS}",
                pod_yaml("a", "10.4.0.1"),
                pod_yaml("c", "10.4.0.33")
            ),
        )
        .unwrap();
        wait_for(&shared, "c to appear", |ix| {
            ix.record(ip("10.4.0.33")).is_some()
        })
        .await;
        let b = shared.read().record(ip("10.4.0.2")).unwrap();
        assert!(
            b.pods.is_empty() && b.tombstone.is_some(),
            "b is gone: {b:?}"
        );

        // A broken file: errors counted, the last good state kept.
        let generation = shared.read().generation();
        std::fs::write(
            &file,
            "kind: Pod\nmetadata: {name: z}\nstatus: {podIPs: nope}\n",
        )
        .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while shared.watch_health()[0].errors == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no error counted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(shared.read().generation(), generation);
        assert!(shared.read().record(ip("10.4.0.33")).is_some());

        // Fixed again: reloaded.
        std::fs::write(&file, pod_yaml("d", "10.4.0.4")).unwrap();
        wait_for(&shared, "d to appear", |ix| {
            ix.record(ip("10.4.0.4")).is_some()
        })
        .await;
        assert!(shared
            .read()
            .record(ip("10.4.0.1"))
            .unwrap()
            .pods
            .is_empty());
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_directory_is_read_whole_and_a_missing_path_fails_to_start() {
        let dir = temp_dir("dir");
        std::fs::write(dir.join("1.yaml"), pod_yaml("a", "10.5.0.1")).unwrap();
        std::fs::write(
            dir.join("2.json"),
            r#"{"kind":"Service","apiVersion":"v1","metadata":{"name":"s","namespace":"x"}}"#,
        )
        .unwrap();
        std::fs::write(dir.join(".swap.yaml"), "not: [valid").unwrap();
        std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
        let shared = SharedIndex::new(
            Index::new(1, IndexConfig::default()),
            Duration::from_secs(60),
        );
        let task = start(dir.clone(), Duration::from_millis(20), shared.clone()).unwrap();
        assert_eq!(shared.read().stats().pods, 1);
        assert_eq!(shared.read().stats().services, 1);
        task.abort();
        let err = start(dir.join("nope.yaml"), Duration::from_millis(20), shared).unwrap_err();
        assert!(err.to_string().contains("nope.yaml"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
