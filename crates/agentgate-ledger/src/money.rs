//! Amounts as integer cents.
//!
//! Why cents and not `DECIMAL`: one `BIGINT` column has the same exact
//! semantics in SQLite, PostgreSQL and MySQL (SQLite has no decimal type and
//! would store `DECIMAL` as a float), `SUM` over it is exact everywhere, and
//! Rust handles it without a decimal crate. Amounts are parsed from their
//! decimal text, never through a float, so "19.99" is 1999 cents.

use serde_json::Value;

use crate::limits::MAX_AMOUNT_CENTS;

/// Parses a tool argument amount (a JSON number or a numeric string such as
/// "35", "35.5", "¥18", "18元") into cents.
///
/// # Errors
/// A message for the model when the amount is missing, not a number, has
/// more than two decimals, is not above zero, or is above the limit.
pub fn parse_amount(value: &Value) -> Result<i64, String> {
    let text = match value {
        Value::Number(number) => number.to_string(),
        Value::String(text) => text.clone(),
        Value::Null => return Err("amount is required".into()),
        other => return Err(format!("amount must be a number, got {other}")),
    };
    let cents = parse_decimal_cents(&text)?;
    if cents <= 0 {
        return Err(format!(
            "amount must be greater than 0, got {}",
            text.trim()
        ));
    }
    if cents > MAX_AMOUNT_CENTS {
        return Err(format!(
            "amount {} is above the limit of {}",
            text.trim(),
            format_cents(MAX_AMOUNT_CENTS)
        ));
    }
    Ok(cents)
}

fn strip_currency(text: &str) -> &str {
    let text = text.trim();
    let text = text
        .trim_start_matches(['¥', '￥', '$'])
        .trim_end_matches("块钱")
        .trim_end_matches(['元', '块']);
    let lower_end = text.len().saturating_sub(4);
    if text.is_char_boundary(lower_end) && text[lower_end..].eq_ignore_ascii_case("yuan") {
        return text[..lower_end].trim();
    }
    text.trim()
}

/// Exact decimal text → cents. Accepts an optional sign, digits, and up to
/// two decimals; exponent forms ("1e3", which JSON allows) go through an
/// integer check.
fn parse_decimal_cents(text: &str) -> Result<i64, String> {
    let raw = strip_currency(text);
    let invalid = || format!("amount {:?} is not a number", text.trim());
    if raw.contains(['e', 'E']) {
        let value: f64 = raw.parse().map_err(|_| invalid())?;
        let cents = (value * 100.0).round();
        if !cents.is_finite() || (value * 100.0 - cents).abs() > 1e-6 || cents.abs() > 1e15 {
            return Err(invalid());
        }
        // Bounded above by 1e15, so the cast is exact.
        #[allow(clippy::cast_possible_truncation)]
        return Ok(cents as i64);
    }
    let (negative, digits) = match raw.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, raw.strip_prefix('+').unwrap_or(raw)),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let all_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
    if whole.is_empty() && fraction.is_empty() || !all_digits(whole) || !all_digits(fraction) {
        return Err(invalid());
    }
    if fraction.len() > 2 {
        return Err(format!(
            "amount {:?} has more than two decimals",
            text.trim()
        ));
    }
    // Sixteen digits of yuan overflow nothing and are far above the limit.
    if whole.len() > 16 {
        return Err(format!("amount {:?} is too large", text.trim()));
    }
    let whole: i64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| invalid())?
    };
    let fraction_cents: i64 = match fraction.len() {
        0 => 0,
        1 => fraction.parse::<i64>().map_err(|_| invalid())? * 10,
        _ => fraction.parse().map_err(|_| invalid())?,
    };
    let cents = whole * 100 + fraction_cents;
    Ok(if negative { -cents } else { cents })
}

/// Cents as decimal text with two decimals: 3550 → "35.50".
pub fn format_cents(cents: i64) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    let abs = cents.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_and_strings_parse_exactly() {
        assert_eq!(parse_amount(&json!(35)), Ok(3500));
        assert_eq!(parse_amount(&json!(35.5)), Ok(3550));
        assert_eq!(parse_amount(&json!(19.99)), Ok(1999));
        assert_eq!(parse_amount(&json!("¥18")), Ok(1800));
        assert_eq!(parse_amount(&json!("18元")), Ok(1800));
        assert_eq!(parse_amount(&json!("18块钱")), Ok(1800));
        assert_eq!(parse_amount(&json!("12.5 yuan")), Ok(1250));
        assert_eq!(parse_amount(&json!(".5")), Ok(50));
        assert_eq!(parse_amount(&json!(1e3)), Ok(100_000));
    }

    #[test]
    fn bad_amounts_are_refused_with_a_reason() {
        assert!(parse_amount(&json!(0))
            .unwrap_err()
            .contains("greater than 0"));
        assert!(parse_amount(&json!(-5))
            .unwrap_err()
            .contains("greater than 0"));
        assert!(parse_amount(&json!(1.234))
            .unwrap_err()
            .contains("two decimals"));
        assert!(parse_amount(&json!("abc"))
            .unwrap_err()
            .contains("not a number"));
        assert!(parse_amount(&json!(null)).unwrap_err().contains("required"));
        assert!(parse_amount(&json!(true)).is_err());
        assert!(parse_amount(&json!(".")).is_err());
        assert!(parse_amount(&json!(100_000_001))
            .unwrap_err()
            .contains("limit"));
        assert_eq!(parse_amount(&json!(100_000_000)), Ok(MAX_AMOUNT_CENTS));
    }

    #[test]
    fn cents_format_with_two_decimals() {
        assert_eq!(format_cents(3550), "35.50");
        assert_eq!(format_cents(5), "0.05");
        assert_eq!(format_cents(-1200), "-12.00");
    }
}
