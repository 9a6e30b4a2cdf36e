//! [`LedgerConfig`]: the app's settings and their defaults (docs/protocol.md §11).

use crate::error::{LedgerError, Result};
use crate::limits::MAX_AMOUNT_CENTS;

/// Settings of the ledger app. The model is chosen separately (see
/// [`crate::model`]); the engine's settings are the [`agentgate::Gate`]'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Entries strictly above this amount (in cents) wait for a person's
    /// confirmation before they are booked. Default 1000 yuan.
    pub confirmation_threshold_cents: i64,
    /// The users' time zone, as minutes east of UTC, used to turn "今天" and
    /// "yesterday" into dates when a message does not say its own. Default
    /// UTC+8: the scenario (seed 000, QingLedger) is a Chinese app.
    pub utc_offset_minutes: i32,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            confirmation_threshold_cents: 1_000 * 100,
            utc_offset_minutes: 8 * 60,
        }
    }
}

/// Widest time-zone offset on Earth is UTC+14; the narrowest UTC−12.
const MAX_UTC_OFFSET_MINUTES: i32 = 14 * 60;

impl LedgerConfig {
    /// Checks every setting against its range.
    ///
    /// # Errors
    /// `Invalid` naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        if !(0..=MAX_AMOUNT_CENTS).contains(&self.confirmation_threshold_cents) {
            return Err(LedgerError::invalid(format!(
                "confirmation_threshold_cents is {}, allowed 0..={MAX_AMOUNT_CENTS}",
                self.confirmation_threshold_cents
            )));
        }
        check_utc_offset(self.utc_offset_minutes)
    }
}

/// Checks a time-zone offset in minutes east of UTC.
///
/// # Errors
/// `Invalid` outside UTC−14..=UTC+14.
pub fn check_utc_offset(minutes: i32) -> Result<()> {
    if minutes.abs() > MAX_UTC_OFFSET_MINUTES {
        return Err(LedgerError::invalid(format!(
            "utc_offset_minutes is {minutes}, allowed -{MAX_UTC_OFFSET_MINUTES}..={MAX_UTC_OFFSET_MINUTES}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bounds_are_enforced() {
        let config = LedgerConfig::default();
        config.validate().expect("defaults are valid");
        assert_eq!(config.confirmation_threshold_cents, 100_000);
        let negative = LedgerConfig {
            confirmation_threshold_cents: -1,
            ..LedgerConfig::default()
        };
        assert!(negative.validate().is_err());
        assert!(check_utc_offset(14 * 60).is_ok());
        assert!(check_utc_offset(14 * 60 + 1).is_err());
    }
}
