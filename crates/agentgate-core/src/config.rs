//! The engine's settings, their defaults (docs/protocol.md §6.3) and their allowed ranges.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::limits;

/// Settings shared by every store and the library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// How long a lease lives without a heartbeat. The watchdog renews every
    /// third of it. Judged on the store's clock.
    pub lease_ttl: Duration,
    /// Concurrent live turns per user unless the user has an override.
    pub max_turns_per_user: u32,
    /// How long finished turns and their tool executions are kept for replay.
    pub result_retention: Duration,
    /// How long a pending confirmation waits for a person before it expires.
    pub confirmation_ttl: Duration,
    /// Records deleted per sweep batch.
    pub sweep_batch: u32,
    /// How often the library's background sweeper runs.
    pub sweep_interval: Duration,
    /// How long an orphan (a running turn whose lease expired without an
    /// ending) waits for a client's retry or a recovery worker before the
    /// sweeper ends it `abandoned`. Never less than the lease TTL in force
    /// (see [`Config::orphan_grace_ms`]); the default, five minutes, is ten
    /// default TTLs.
    pub orphan_grace: Duration,
    /// How long a running turn asked to stop ([`crate::store::Store::request_cancel`])
    /// has to end itself before the sweeper force-releases it
    /// ([`crate::store::Store::release_ignored_cancels`]): a holder that
    /// ignores the request, or cannot hear it, must not keep the session
    /// for as long as it heartbeats. The default, a minute, is two default
    /// TTLs; the release comes within one `sweep_interval` after it.
    pub cancel_grace: Duration,
    /// Pooled connections a PostgreSQL or MySQL store keeps (SQLite has
    /// one writer of its own). Ten keep a 2–8 core server busy; several app
    /// nodes times ten stays under the servers' default connection limits.
    pub store_connections: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(30),
            max_turns_per_user: 5,
            result_retention: Duration::from_secs(24 * 3600),
            confirmation_ttl: Duration::from_secs(24 * 3600),
            sweep_batch: limits::DEFAULT_SWEEP_BATCH,
            sweep_interval: Duration::from_secs(60),
            orphan_grace: Duration::from_secs(5 * 60),
            cancel_grace: limits::DEFAULT_CANCEL_GRACE,
            store_connections: limits::DEFAULT_STORE_CONNECTIONS,
        }
    }
}

fn in_range(what: &str, value: Duration, min: Duration, max: Duration) -> Result<()> {
    if value < min || value > max {
        return Err(Error::invalid(format!(
            "{what} is {} ms, allowed {}..={} ms",
            value.as_millis(),
            min.as_millis(),
            max.as_millis()
        )));
    }
    Ok(())
}

/// Checks a per-user cap against its range.
///
/// # Errors
/// `invalid_request` when `cap` is 0 or above [`limits::MAX_TURNS_PER_USER`].
pub fn check_cap(cap: u32) -> Result<()> {
    if cap == 0 || cap > limits::MAX_TURNS_PER_USER {
        return Err(Error::invalid(format!(
            "max_turns_per_user is {cap}, allowed 1..={}",
            limits::MAX_TURNS_PER_USER
        )));
    }
    Ok(())
}

impl Config {
    /// Checks every setting against its range.
    ///
    /// # Errors
    /// `invalid_request` naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        in_range(
            "lease_ttl",
            self.lease_ttl,
            limits::MIN_LEASE_TTL,
            limits::MAX_LEASE_TTL,
        )?;
        check_cap(self.max_turns_per_user)?;
        if self.store_connections == 0 || self.store_connections > limits::MAX_STORE_CONNECTIONS {
            return Err(Error::invalid(format!(
                "store_connections is {}, allowed 1..={}",
                self.store_connections,
                limits::MAX_STORE_CONNECTIONS
            )));
        }
        in_range(
            "result_retention",
            self.result_retention,
            limits::MIN_RETENTION,
            limits::MAX_RETENTION,
        )?;
        in_range(
            "confirmation_ttl",
            self.confirmation_ttl,
            limits::MIN_RETENTION,
            limits::MAX_RETENTION,
        )?;
        if self.sweep_batch == 0 || self.sweep_batch > limits::MAX_SWEEP_BATCH {
            return Err(Error::invalid(format!(
                "sweep_batch is {}, allowed 1..={}",
                self.sweep_batch,
                limits::MAX_SWEEP_BATCH
            )));
        }
        in_range(
            "sweep_interval",
            self.sweep_interval,
            Duration::from_millis(10),
            limits::MAX_RETENTION,
        )?;
        in_range(
            "orphan_grace",
            self.orphan_grace,
            limits::MIN_ORPHAN_GRACE,
            limits::MAX_ORPHAN_GRACE,
        )?;
        in_range(
            "cancel_grace",
            self.cancel_grace,
            limits::MIN_CANCEL_GRACE,
            limits::MAX_CANCEL_GRACE,
        )
    }

    /// The cancel grace in milliseconds, as stores use it.
    pub fn cancel_grace_ms(&self) -> i64 {
        duration_ms(self.cancel_grace)
    }

    /// The orphan grace in force, in milliseconds: the configured grace, or
    /// the lease TTL if that is longer, so a client that retries within one
    /// TTL of its lease expiring always finds its turn still running.
    pub fn orphan_grace_ms(&self) -> i64 {
        duration_ms(self.orphan_grace.max(self.lease_ttl))
    }

    /// The lease TTL in milliseconds, as stores use it.
    pub fn lease_ttl_ms(&self) -> i64 {
        duration_ms(self.lease_ttl)
    }
}

/// A duration as whole milliseconds, saturating.
pub fn duration_ms(value: Duration) -> i64 {
    i64::try_from(value.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_the_spec() {
        let config = Config::default();
        config.validate().unwrap();
        assert_eq!(config.lease_ttl, Duration::from_secs(30));
        assert_eq!(config.max_turns_per_user, 5);
    }

    #[test]
    fn out_of_range_settings_are_rejected() {
        let too_short = Config {
            lease_ttl: Duration::from_millis(99),
            ..Config::default()
        };
        assert!(too_short.validate().is_err());
        let no_cap = Config {
            max_turns_per_user: 0,
            ..Config::default()
        };
        assert!(no_cap.validate().is_err());
        assert!(check_cap(limits::MAX_TURNS_PER_USER).is_ok());
        assert!(check_cap(limits::MAX_TURNS_PER_USER + 1).is_err());
    }

    #[test]
    fn orphan_grace_is_at_least_the_lease_ttl_and_within_its_range() {
        let under_ttl = Config {
            orphan_grace: Duration::from_secs(2),
            ..Config::default()
        };
        under_ttl.validate().unwrap();
        assert_eq!(under_ttl.orphan_grace_ms(), 30_000);
        assert_eq!(Config::default().orphan_grace_ms(), 300_000);
        let too_short = Config {
            orphan_grace: Duration::from_millis(999),
            ..Config::default()
        };
        let error = too_short.validate().unwrap_err();
        assert!(error.to_string().contains("orphan_grace"), "{error}");
        let too_long = Config {
            orphan_grace: limits::MAX_ORPHAN_GRACE + Duration::from_millis(1),
            ..Config::default()
        };
        assert!(too_long.validate().is_err());
    }
}
