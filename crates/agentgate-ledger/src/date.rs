//! Calendar dates for entries: a small proleptic-Gregorian [`Date`], the
//! user's "today" from a store-clock instant and a time-zone offset, and the
//! date words a model may pass (`今天`, `昨天`, `前天`, `today`, `yesterday`,
//! `2024-05-01`, `5月1日`).
//!
//! No date crate: entries need days, not time zones with rules, and the
//! arithmetic is a dozen lines (Howard Hinnant's `days_from_civil`).

use std::fmt;

/// Earliest year an entry may be dated: a personal ledger in a chat app.
const MIN_YEAR: i32 = 1970;

/// Latest year an entry may be dated.
const MAX_YEAR: i32 = 9999;

/// A calendar date.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Date {
    year: i32,
    month: u32,
    day: u32,
}

fn days_in_month(year: i32, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        _ => 28,
    }
}

impl Date {
    /// A date, if it exists and lies in the accepted years.
    pub fn new(year: i32, month: u32, day: u32) -> Option<Self> {
        let valid = (MIN_YEAR..=MAX_YEAR).contains(&year)
            && (1..=12).contains(&month)
            && day >= 1
            && day <= days_in_month(year, month);
        valid.then_some(Self { year, month, day })
    }

    /// The year.
    pub fn year(self) -> i32 {
        self.year
    }

    /// Days since 1970-01-01.
    pub fn days_since_epoch(self) -> i64 {
        let year = i64::from(self.year) - i64::from(self.month <= 2);
        let era = year.div_euclid(400);
        let year_of_era = year - era * 400;
        let month = i64::from(self.month);
        let day_of_year =
            (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + i64::from(self.day) - 1;
        let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
        era * 146_097 + day_of_era - 719_468
    }

    /// The date `days` days after 1970-01-01, clamped to the accepted years
    /// (1970-01-01 ..= 9999-12-31).
    pub fn from_days_since_epoch(days: i64) -> Self {
        /// Days from 1970-01-01 to 9999-12-31.
        const LAST_DAY: i64 = 2_932_896;
        let z = days.clamp(0, LAST_DAY) + 719_468;
        let era = z.div_euclid(146_097);
        let day_of_era = z - era * 146_097;
        let year_of_era =
            (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
        let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
        let mp = (5 * day_of_year + 2) / 153;
        let day = day_of_year - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = year_of_era + era * 400 + i64::from(month <= 2);
        let year = i32::try_from(year).expect("clamped to years 1970..=9999");
        Self {
            year,
            month: u32::try_from(month).expect("month is 1..=12"),
            day: u32::try_from(day).expect("day is 1..=31"),
        }
    }

    /// The local date at `unix_ms` in a zone `utc_offset_minutes` east of UTC.
    pub fn at_unix_ms(unix_ms: i64, utc_offset_minutes: i32) -> Self {
        let local_ms = unix_ms + i64::from(utc_offset_minutes) * 60_000;
        Self::from_days_since_epoch(local_ms.div_euclid(86_400_000))
    }

    /// This date moved by `days` (negative for the past).
    pub fn add_days(self, days: i64) -> Self {
        Self::from_days_since_epoch(self.days_since_epoch() + days)
    }

    /// Parses `YYYY-MM-DD` (also with `/` or `.`).
    pub fn parse_iso(text: &str) -> Option<Self> {
        let mut parts = text.trim().split(['-', '/', '.']);
        let year = parts.next()?.parse().ok()?;
        let month = parts.next()?.parse().ok()?;
        let day = parts.next()?.parse().ok()?;
        if parts.next().is_some() {
            return None;
        }
        Self::new(year, month, day)
    }
}

impl fmt::Display for Date {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }
}

/// Relative date words and their offset in days from today, longest first
/// so "大前天" is not read as "前天".
pub const RELATIVE_DATE_WORDS: &[(&str, i64)] = &[
    ("day before yesterday", -2),
    ("yesterday", -1),
    ("today", 0),
    ("大前天", -3),
    ("前天", -2),
    ("昨天", -1),
    ("昨日", -1),
    ("昨晚", -1),
    ("今天", 0),
    ("今日", 0),
    ("今晚", 0),
];

/// Resolves a date argument against `today`: a relative word, an ISO date,
/// or `M月D日` / `M月D号` (this year). `None` or an empty text means today.
///
/// # Errors
/// A message for the model when the text is not a date it understands.
pub fn resolve(text: Option<&str>, today: Date) -> Result<Date, String> {
    let Some(text) = text.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(today);
    };
    let lower = text.to_lowercase();
    if let Some((_, offset)) = RELATIVE_DATE_WORDS.iter().find(|(word, _)| lower == *word) {
        return Ok(today.add_days(*offset));
    }
    if let Some(date) = Date::parse_iso(text) {
        return Ok(date);
    }
    if let Some(date) = parse_month_day(text, today.year()) {
        return Ok(date);
    }
    Err(format!(
        "occur_date {text:?} is not a date; use YYYY-MM-DD, today or yesterday"
    ))
}

fn parse_month_day(text: &str, year: i32) -> Option<Date> {
    let (month, rest) = text.split_once('月')?;
    let day = rest
        .strip_suffix('日')
        .or_else(|| rest.strip_suffix('号'))?;
    Date::new(year, month.trim().parse().ok()?, day.trim().parse().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_round_trip_across_leap_years_and_eras() {
        for days in [0, 59, 60, 365, 10_957, 11_016, 19_783, 2_932_896] {
            let date = Date::from_days_since_epoch(days);
            assert_eq!(date.days_since_epoch(), days, "{date}");
        }
        assert_eq!(Date::from_days_since_epoch(0).to_string(), "1970-01-01");
        assert_eq!(Date::from_days_since_epoch(-1).to_string(), "1970-01-01");
        assert_eq!(
            Date::from_days_since_epoch(2_932_896).to_string(),
            "9999-12-31"
        );
        assert_eq!(
            Date::from_days_since_epoch(i64::MAX / 2).to_string(),
            "9999-12-31"
        );
        assert_eq!(
            Date::from_days_since_epoch(11_016).to_string(),
            "2000-02-29"
        );
        assert_eq!(
            Date::parse_iso("2024-03-01").map(|d| d.add_days(-1).to_string()),
            Some("2024-02-29".into())
        );
    }

    #[test]
    fn today_follows_the_zone_offset() {
        // 2024-05-01T20:00:00Z is already 2024-05-02 in UTC+8.
        let instant_ms = Date::parse_iso("2024-05-01")
            .expect("date")
            .days_since_epoch()
            * 86_400_000
            + 20 * 3_600_000;
        assert_eq!(Date::at_unix_ms(instant_ms, 0).to_string(), "2024-05-01");
        assert_eq!(Date::at_unix_ms(instant_ms, 480).to_string(), "2024-05-02");
        assert_eq!(Date::at_unix_ms(instant_ms, -300).to_string(), "2024-05-01");
    }

    #[test]
    fn date_words_resolve_and_garbage_is_refused() {
        let today = Date::new(2024, 5, 1).expect("date");
        let resolve_text = |t: &str| resolve(Some(t), today).map(|d| d.to_string());
        assert_eq!(resolve(None, today), Ok(today));
        assert_eq!(resolve_text("昨天"), Ok("2024-04-30".into()));
        assert_eq!(resolve_text("前天"), Ok("2024-04-29".into()));
        assert_eq!(resolve_text("Yesterday"), Ok("2024-04-30".into()));
        assert_eq!(resolve_text("2024/04/03"), Ok("2024-04-03".into()));
        assert_eq!(resolve_text("3月5日"), Ok("2024-03-05".into()));
        assert!(resolve_text("2024-13-45").is_err());
        assert!(resolve_text("someday").is_err());
        assert!(Date::new(2023, 2, 29).is_none());
        assert!(Date::new(1969, 12, 31).is_none());
    }
}
