//! A [`Host`] for tests: shared data in memory, a clock the test moves, and a
//! record of what the engine did (replies, calls, metrics, timer periods).

use std::collections::HashMap;
use std::io::Read;
use std::time::Duration;

use crate::host::{
    Callouts, Clock, MetricKind, RawHeaders, SharedData, Stats, StoreError, Stream, Vm,
};
use crate::store::MemoryStore;

/// A reply the filter sent instead of the upstream's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u32,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }
}

/// A call the filter dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) token: u32,
    pub(crate) cluster: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) timeout: Duration,
}

impl Call {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }
}

/// The value of header `name` in a list the double keeps.
fn find<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A header list the filter passed, as the double keeps it.
fn owned(headers: &[(&str, &str)]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A header list the double keeps, as the host gives it.
fn raw(headers: &[(String, String)]) -> RawHeaders {
    headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
        .collect()
}

/// The answer being delivered to `call_response`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answer {
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

#[derive(Debug, Default)]
pub(crate) struct FakeHost {
    pub(crate) store: MemoryStore,
    pub(crate) now_ms: u64,
    /// Properties by their path joined with `.`.
    pub(crate) properties: HashMap<String, String>,
    pub(crate) request_headers: Vec<(String, String)>,
    pub(crate) removed_headers: Vec<String>,
    pub(crate) removed_response_headers: Vec<String>,
    /// Set: `dispatch_call` fails.
    pub(crate) refuse_calls: bool,
    pub(crate) calls: Vec<Call>,
    pub(crate) answer: Answer,
    pub(crate) replies: Vec<Reply>,
    pub(crate) metric_names: Vec<(MetricKind, String)>,
    pub(crate) counters: HashMap<String, u64>,
    pub(crate) gauges: HashMap<String, u64>,
    pub(crate) tick_periods: Vec<u64>,
    /// Mixed into what `random_u64` returns: two roots on one host take
    /// different lease owner ids when a test changes it between them.
    pub(crate) random: u64,
    /// Set: the store counts its writes, as the native module's does
    /// (`SharedData::writes`); every `set` moves it.
    pub(crate) writes: Option<u64>,
}

impl FakeHost {
    /// The counter `name`, 0 when never incremented.
    pub(crate) fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    /// The timer period last set, in ms.
    pub(crate) fn timer_ms(&self) -> Option<u64> {
        self.tick_periods.last().copied()
    }

    /// Headers of the next answer, `:status` first.
    pub(crate) fn answer_with(&mut self, status: u32, body: Vec<u8>) {
        self.answer = Answer {
            headers: vec![(":status".to_owned(), status.to_string())],
            body,
        };
    }
}

impl SharedData for FakeHost {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        self.store.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)?;
        if let Some(writes) = &mut self.writes {
            *writes += 1;
        }
        Ok(())
    }

    fn writes(&self) -> Option<u64> {
        self.writes
    }
}

impl Clock for FakeHost {
    fn now_us(&self) -> u64 {
        self.now_ms * 1000
    }

    fn random_u64(&self) -> u64 {
        42 ^ self.random
    }
}

impl Stream for FakeHost {
    fn property(&self, path: &[&str]) -> Option<String> {
        self.properties.get(&path.join(".")).cloned()
    }

    fn request_header(&self, name: &str) -> Option<String> {
        find(&self.request_headers, name).map(str::to_owned)
    }

    fn request_headers(&self) -> RawHeaders {
        raw(&self.request_headers)
    }

    fn remove_request_header(&mut self, name: &str) {
        self.removed_headers.push(name.to_owned());
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.request_headers.retain(|(k, _)| k != name);
        self.request_headers
            .push((name.to_owned(), value.to_owned()));
    }

    fn remove_response_header(&mut self, name: &str) {
        self.removed_response_headers.push(name.to_owned());
    }

    fn send_reply(&mut self, status: u32, headers: &[(&str, &str)], body: Option<&[u8]>) {
        self.replies.push(Reply {
            status,
            headers: owned(headers),
            body: body.unwrap_or_default().to_vec(),
        });
    }
}

impl Callouts for FakeHost {
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<u32, String> {
        if self.refuse_calls {
            return Err("BadArgument".to_owned());
        }
        let token = u32::try_from(self.calls.len()).unwrap() + 1;
        self.calls.push(Call {
            token,
            cluster: cluster.to_owned(),
            headers: owned(headers),
            timeout,
        });
        Ok(token)
    }

    fn call_status(&self) -> Option<u32> {
        find(&self.answer.headers, ":status")?.parse().ok()
    }

    fn call_headers(&self) -> RawHeaders {
        raw(&self.answer.headers)
    }

    fn call_body(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        let end = offset.saturating_add(len).min(self.answer.body.len());
        Ok(self
            .answer
            .body
            .get(offset.min(end)..end)
            .unwrap_or_default()
            .to_vec())
    }

    fn call_body_reader(&self, size: usize) -> Box<dyn Read> {
        let body = self.answer.body.get(..size).unwrap_or_default().to_vec();
        Box::new(std::io::Cursor::new(body))
    }
}

impl Stats for FakeHost {
    fn define_metric(&mut self, kind: MetricKind, name: &str) -> Option<u32> {
        self.metric_names.push((kind, name.to_owned()));
        u32::try_from(self.metric_names.len() - 1).ok()
    }

    fn increment_metric(&mut self, id: u32, by: u64) {
        if let Some((MetricKind::Counter, name)) = self.metric_names.get(id as usize) {
            *self.counters.entry(name.clone()).or_insert(0) += by;
        }
    }

    fn record_metric(&mut self, id: u32, value: u64) {
        if let Some((MetricKind::Gauge, name)) = self.metric_names.get(id as usize) {
            self.gauges.insert(name.clone(), value);
        }
    }
}

impl Vm for FakeHost {
    fn set_tick_period(&mut self, period: Duration) -> bool {
        self.tick_periods
            .push(u64::try_from(period.as_millis()).unwrap());
        true
    }

    fn vm_memory_bytes(&self) -> u64 {
        1 << 20
    }
}

/// The plugin configuration `deploy/envoy/envoy.yaml` ships (its first
/// `value: |` JSON), with `extra` fields merged on top.
pub(crate) fn shipped_config(extra: &str) -> Vec<u8> {
    let yaml = include_str!("../../deploy/envoy/envoy.yaml");
    let from = yaml.find("value: |").unwrap();
    let start = from + yaml[from..].find('{').unwrap();
    let mut depth = 0;
    let mut end = start;
    for (i, c) in yaml[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = start + i + 1;
                    break;
                }
            }
            _ => {}
        }
    }
    let mut config: serde_json::Value = serde_json::from_str(&yaml[start..end]).unwrap();
    let extra: serde_json::Value = serde_json::from_str(extra).unwrap();
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    serde_json::to_vec(&config).unwrap()
}
