//! Latency samples and their percentiles.
//!
//! Samples are kept whole (a 10 s run at a few thousand turns/s is tens of
//! thousands of durations, well under a megabyte) and sorted once, so the
//! percentiles are exact, not bucketed.

use std::time::Duration;

use serde::Serialize;

/// The latency of one step, summarised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepLatency {
    /// Samples measured.
    pub count: u64,
    /// Median, in milliseconds.
    pub p50_ms: f64,
    /// 99th percentile, in milliseconds.
    pub p99_ms: f64,
    /// Mean, in milliseconds.
    pub mean_ms: f64,
}

/// Durations of one step, in arrival order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Samples(Vec<Duration>);

impl Samples {
    pub(crate) fn push(&mut self, value: Duration) {
        self.0.push(value);
    }

    pub(crate) fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    /// The summary; all zero without samples.
    pub(crate) fn summary(&self) -> StepLatency {
        if self.0.is_empty() {
            return StepLatency::default();
        }
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        let total: Duration = sorted.iter().sum();
        let count = sorted.len();
        StepLatency {
            count: count as u64,
            p50_ms: millis(percentile(&sorted, 50)),
            p99_ms: millis(percentile(&sorted, 99)),
            mean_ms: millis(total) / count as f64,
        }
    }
}

/// The `percent`th percentile of `sorted` by the nearest-rank method.
fn percentile(sorted: &[Duration], percent: usize) -> Duration {
    debug_assert!(!sorted.is_empty() && percent <= 100);
    let rank = (percent * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

/// A duration in fractional milliseconds.
pub(crate) fn millis(value: Duration) -> f64 {
    value.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut samples = Samples::default();
        for ms in 1..=100 {
            samples.push(Duration::from_millis(ms));
        }
        let summary = samples.summary();
        assert_eq!(summary.count, 100);
        assert!((summary.p50_ms - 50.0).abs() < 1e-9);
        assert!((summary.p99_ms - 99.0).abs() < 1e-9);
        assert!((summary.mean_ms - 50.5).abs() < 1e-9);
        assert_eq!(Samples::default().summary(), StepLatency::default());
        let mut one = Samples::default();
        one.push(Duration::from_millis(7));
        assert!((one.summary().p99_ms - 7.0).abs() < 1e-9);
    }
}
