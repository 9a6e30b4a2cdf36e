//! The progress bar on stderr: one tick per phase, the phase's name beside
//! it. Hidden when stderr is not a terminal (indicatif's own check) or when
//! the run is too short to need one.

use std::borrow::Cow;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the bar redraws its clock while a phase runs.
const TICK: Duration = Duration::from_millis(200);

/// The run's progress.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `phases` phases, drawn on stderr if `show`.
    pub(crate) fn new(show: bool, phases: u64) -> Self {
        let target = if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(phases), target);
        if let Ok(style) =
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {wide_msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        if show {
            bar.enable_steady_tick(TICK);
        }
        Self { bar }
    }

    /// Names the phase now running.
    pub(crate) fn phase(&self, name: impl Into<Cow<'static, str>>) {
        self.bar.set_message(name);
    }

    /// Marks a phase done.
    pub(crate) fn done(&self) {
        self.bar.inc(1);
    }

    /// Removes the bar.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
