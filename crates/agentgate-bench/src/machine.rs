//! The machine a run is on, read from `/proc` (Linux), so a report says
//! what its numbers were measured on, and how busy the machine was.

use serde::Serialize;

/// The machine, as far as `/proc` tells.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub nproc: usize,
    /// `model name` of the first CPU in `/proc/cpuinfo`.
    pub cpu_model: Option<String>,
    /// `MemTotal` of `/proc/meminfo`, MiB.
    pub memory_mib: Option<u64>,
    /// 1-minute load average when the run started.
    pub load_start: Option<f64>,
    /// 1-minute load average when the run ended.
    pub load_end: Option<f64>,
}

/// The 1-minute load average.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Machine {
    /// Reads the machine now (the load average is the start's).
    pub(crate) fn read() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|line| line.starts_with("model name"))
                    .and_then(|line| line.split_once(':'))
                    .map(|(_, model)| model.trim().to_owned())
            });
        let memory_mib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|line| line.strip_prefix("MemTotal:"))
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|kib| kib.parse::<u64>().ok())
            })
            .map(|kib| kib / 1024);
        Self {
            nproc: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_mib,
            load_start: load_average(),
            load_end: None,
        }
    }

    /// One line for people.
    pub(crate) fn summary(&self) -> String {
        format!(
            "{} CPUs ({}), {} MiB, load {} -> {}",
            self.nproc,
            self.cpu_model.as_deref().unwrap_or("unknown CPU"),
            self.memory_mib
                .map_or_else(|| "?".to_owned(), |m| m.to_string()),
            self.load_start
                .map_or_else(|| "?".to_owned(), |l| format!("{l:.2}")),
            self.load_end
                .map_or_else(|| "?".to_owned(), |l| format!("{l:.2}")),
        )
    }
}
