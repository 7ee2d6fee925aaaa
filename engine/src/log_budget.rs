//! A log budget: at most a few verdict log lines per second per VM.
//!
//! During an incident every request to a stale host is rejected; one log line
//! each would flood Envoy's log exactly when operators need it. The counters
//! count everything; the log shows a sample and says how much it skipped.

/// Allows `per_window` events per `window_ms`, and reports what it suppressed.
#[derive(Debug, Clone)]
pub struct LogBudget {
    window_ms: u64,
    per_window: u32,
    window_start: u64,
    used: u32,
    suppressed: u64,
}

impl LogBudget {
    /// A budget of `per_window` events per `window_ms`.
    pub fn new(window_ms: u64, per_window: u32) -> Self {
        Self {
            window_ms,
            per_window,
            window_start: 0,
            used: 0,
            suppressed: 0,
        }
    }

    /// Asks to log at `now_ms`. `Some(n)` allows it, `n` being how many
    /// events were suppressed since the last allowed one; `None` suppresses.
    pub fn allow(&mut self, now_ms: u64) -> Option<u64> {
        if now_ms >= self.window_start.saturating_add(self.window_ms) || now_ms < self.window_start
        {
            self.window_start = now_ms;
            self.used = 0;
        }
        if self.used < self.per_window {
            self.used += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed = self.suppressed.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_a_budget_per_window_and_reports_the_rest() {
        let mut t = LogBudget::new(1_000, 2);
        assert_eq!(t.allow(0), Some(0));
        assert_eq!(t.allow(10), Some(0));
        assert_eq!(t.allow(20), None);
        assert_eq!(t.allow(30), None);
        assert_eq!(
            t.allow(1_000),
            Some(2),
            "the next window reports what was skipped"
        );
        assert_eq!(t.allow(1_001), Some(0));
        assert_eq!(t.allow(500), Some(0), "a clock step back opens a window");
    }
}
