//! RFC 8785 (JSON Canonicalization Scheme) conformance of
//! `agentgate_core::canonical`: the RFC's own examples (§3.2.2, §3.2.3,
//! §3.2.4 and the number table of Appendix B), string escaping, what happens
//! to numbers that `serde_json` holds as integers beyond 2^53, and properties
//! over arbitrary JSON: key order, whitespace, number spelling and string
//! escape spelling never change the digest, and values that differ (in the
//! RFC's data model, where every number is an IEEE-754 double) never share
//! canonical text.

use agentgate_core::canonical::{canonicalize, digest, CanonicalJson};
use agentgate_core::ErrorKind;
use proptest::prelude::*;
use serde_json::{Map, Number, Value};
use sha2::{Digest as _, Sha256};

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("test input {text:?} is JSON: {e}"))
}

fn canonical(value: &Value) -> String {
    canonicalize("test", value).unwrap_or_else(|e| panic!("{value:?} is within the limits: {e:?}"))
}

fn canonical_text(text: &str) -> String {
    canonical(&parse(text))
}

fn digest_hex(value: &Value) -> String {
    digest("test", value)
        .unwrap_or_else(|e| panic!("{value:?} is within the limits: {e:?}"))
        .as_hex()
        .to_owned()
}

// ---- the RFC's examples ----------------------------------------------------

/// RFC 8785 §3.2.2: the example object, and §3.2.4: its UTF-8 bytes.
const RFC_INPUT: &str = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;

const RFC_OUTPUT: &str = "{\"literals\":[null,true,false],\
\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\
\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";

/// RFC 8785 §3.2.4, as printed there.
const RFC_OUTPUT_UTF8_HEX: &str = "
7b 22 6c 69 74 65 72 61 6c 73 22 3a 5b 6e 75 6c 6c 2c 74 72
75 65 2c 66 61 6c 73 65 5d 2c 22 6e 75 6d 62 65 72 73 22 3a
5b 33 33 33 33 33 33 33 33 33 2e 33 33 33 33 33 33 33 2c 31
65 2b 33 30 2c 34 2e 35 2c 30 2e 30 30 32 2c 31 65 2d 32 37
5d 2c 22 73 74 72 69 6e 67 22 3a 22 e2 82 ac 24 5c 75 30 30
30 66 5c 6e 41 27 42 5c 22 5c 5c 5c 5c 5c 22 2f 22 7d";

#[test]
fn rfc_3_2_2_example_canonicalises_to_the_rfc_output() {
    assert_eq!(canonical_text(RFC_INPUT), RFC_OUTPUT);
}

#[test]
fn rfc_3_2_4_output_is_the_rfcs_utf8_bytes() {
    let expected: String = RFC_OUTPUT_UTF8_HEX.split_whitespace().collect();
    assert_eq!(hex::encode(canonical_text(RFC_INPUT).as_bytes()), expected);
}

/// RFC 8785 §3.2.3: properties sort by UTF-16 code units, not by UTF-8 bytes
/// or code points, so U+1F600 (a surrogate pair, 0xD83D...) sorts before
/// U+FB33.
#[test]
fn rfc_3_2_3_properties_sort_by_utf16_code_units() {
    let input = r#"{
      "\u20ac": "Euro Sign",
      "\r": "Carriage Return",
      "\ufb33": "Hebrew Letter Dalet With Dagesh",
      "1": "One",
      "\ud83d\ude00": "Emoji: Grinning Face",
      "\u0080": "Control",
      "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let expected = concat!(
        "{",
        r#""\r":"Carriage Return","#,
        r#""1":"One","#,
        "\"\u{80}\":\"Control\",",
        "\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",",
        "\"\u{20ac}\":\"Euro Sign\",",
        "\"\u{1f600}\":\"Emoji: Grinning Face\",",
        "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"",
        "}"
    );
    assert_eq!(canonical_text(input), expected);
    // serde_json's own map order (UTF-8 bytes) puts U+FB33 before U+1F600:
    // the canonicaliser must not just reuse it.
    let plain = serde_json::to_string(&parse(input)).expect("a Value serialises");
    assert_ne!(plain, expected);
}

#[test]
fn nested_objects_are_sorted_and_arrays_keep_their_order() {
    let text = r#"{"b": [3, {"z": 1, "a": 2}, 1], "a": {"d": null, "c": []}}"#;
    assert_eq!(
        canonical_text(text),
        r#"{"a":{"c":[],"d":null},"b":[3,{"a":2,"z":1},1]}"#
    );
}

#[test]
fn whitespace_between_tokens_is_dropped() {
    let text = " \t\r\n{ \"a\" :\n[ 1 ,\ttrue , \"x y\" ] } \n";
    assert_eq!(canonical_text(text), r#"{"a":[1,true,"x y"]}"#);
}

// ---- numbers: RFC 8785 Appendix B -------------------------------------------

/// Appendix B: IEEE-754 bits and their canonical spelling (ECMAScript's
/// Number.prototype.toString). NaN (7fffffffffffffff) and Infinity
/// (7ff0000000000000) are left out: a `serde_json::Value` cannot hold them,
/// see `non_finite_numbers_cannot_reach_the_canonicaliser`.
const APPENDIX_B: [(u64, &str); 24] = [
    (0x0000_0000_0000_0000, "0"),
    (0x8000_0000_0000_0000, "0"), // minus zero
    (0x0000_0000_0000_0001, "5e-324"),
    (0x8000_0000_0000_0001, "-5e-324"),
    (0x7fef_ffff_ffff_ffff, "1.7976931348623157e+308"),
    (0xffef_ffff_ffff_ffff, "-1.7976931348623157e+308"),
    (0x4340_0000_0000_0000, "9007199254740992"),
    (0xc340_0000_0000_0000, "-9007199254740992"),
    (0x4430_0000_0000_0000, "295147905179352830000"),
    (0x44b5_2d02_c7e1_4af5, "9.999999999999997e+22"),
    (0x44b5_2d02_c7e1_4af6, "1e+23"),
    (0x44b5_2d02_c7e1_4af7, "1.0000000000000001e+23"),
    (0x444b_1ae4_d6e2_ef4e, "999999999999999700000"),
    (0x444b_1ae4_d6e2_ef4f, "999999999999999900000"),
    (0x444b_1ae4_d6e2_ef50, "1e+21"),
    (0x3eb0_c6f7_a0b5_ed8c, "9.999999999999997e-7"),
    (0x3eb0_c6f7_a0b5_ed8d, "0.000001"),
    (0x41b3_de43_5555_5553, "333333333.3333332"),
    (0x41b3_de43_5555_5554, "333333333.33333325"),
    (0x41b3_de43_5555_5555, "333333333.3333333"),
    (0x41b3_de43_5555_5556, "333333333.3333334"),
    (0x41b3_de43_5555_5557, "333333333.33333343"),
    (0xbecb_f647_612f_3696, "-0.0000033333333333333333"),
    (0x4314_3ff3_c1cb_0959, "1424953923781206.2"), // round to even
];

#[test]
fn appendix_b_doubles_serialise_as_the_rfc_says() {
    for (bits, expected) in APPENDIX_B {
        let double = f64::from_bits(bits);
        let number = Number::from_f64(double).expect("the table's values are finite");
        assert_eq!(
            canonical(&Value::Number(number)),
            expected,
            "bits {bits:016x}"
        );
    }
}

#[test]
fn appendix_b_spellings_parse_back_to_the_same_doubles() {
    // Guards the table above against a typo, and checks the parse side: the
    // canonical text, read by serde_json, is the same double (minus zero
    // apart, which JCS spells "0").
    for (bits, expected) in APPENDIX_B {
        let reparsed = parse(expected).as_f64().expect("a JSON number is an f64");
        if bits == 0x8000_0000_0000_0000 {
            assert_eq!(reparsed, 0.0);
        } else {
            assert_eq!(reparsed.to_bits(), bits, "{expected}");
        }
        assert_eq!(canonical_text(expected), expected);
    }
}

#[test]
fn number_spellings_from_json_text_serialise_as_ecmascript_does() {
    let cases = [
        ("1e30", "1e+30"),
        ("1E30", "1e+30"),
        ("1e+30", "1e+30"),
        ("4.50", "4.5"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("0e10", "0"),
        ("1e-7", "1e-7"),
        ("0.0000001", "1e-7"),
        ("0.000001", "0.000001"),
        ("1e-6", "0.000001"),
        ("1e21", "1e+21"),
        ("1e20", "100000000000000000000"),
        ("100000000000000000000.0", "100000000000000000000"),
        ("9007199254740992", "9007199254740992"),
        ("-9007199254740992", "-9007199254740992"),
        ("333333333.33333329", "333333333.3333333"),
        ("2e-3", "0.002"),
        ("0.000000000000000000000000001", "1e-27"),
        ("1e23", "1e+23"),
        ("295147905179352830000", "295147905179352830000"),
        ("1e2", "100"),
        ("100.000", "100"),
        ("1.0", "1"),
        ("-1.5E0", "-1.5"),
        ("0.1", "0.1"),
        ("123456789012345680000", "123456789012345680000"),
    ];
    for (text, expected) in cases {
        assert_eq!(canonical_text(text), expected, "input {text}");
    }
}

/// serde_json reads an integer literal into an i64 or u64 when it fits, and
/// only otherwise into an f64. The canonicaliser (serde_json_canonicalizer)
/// writes every integer as `value as f64`, which rounds to nearest, ties to
/// even, exactly as an RFC 8785 parser reading the text as a double would.
/// So integers beyond 2^53 lose precision, as the RFC intends (§3.2.2.3:
/// larger integers belong in strings) and it does not matter whether serde_json
/// held the value as u64, i64 or f64. The consequence for agentgate: two
/// payloads (or tool args) that differ only in an integer beyond 2^53 have the
/// same fingerprint (args hash): a repeat is a replay, not a payload mismatch.
#[test]
fn integers_beyond_2_pow_53_are_read_as_doubles_as_the_rfc_prescribes() {
    let cases = [
        // 2^53 + 1 is not a double; it rounds (to even) down to 2^53.
        ("9007199254740993", "9007199254740992"),
        ("9007199254740993.0", "9007199254740992"),
        ("9007199254740995", "9007199254740996"),
        ("-9007199254740993", "-9007199254740992"),
        // u64::MAX, held as u64; u64::MAX + 1, held as f64: one double.
        ("18446744073709551615", "18446744073709552000"),
        ("18446744073709551616", "18446744073709552000"),
        // i64::MIN, held as i64.
        ("-9223372036854775808", "-9223372036854776000"),
    ];
    for (text, expected) in cases {
        assert_eq!(canonical_text(text), expected, "input {text}");
    }
    assert_eq!(
        digest_hex(&parse(r#"{"id": 9007199254740993}"#)),
        digest_hex(&parse(r#"{"id": 9007199254740992}"#)),
        "integers beyond 2^53 that round to one double share a digest"
    );
    assert_ne!(
        digest_hex(&parse(r#"{"id": "9007199254740993"}"#)),
        digest_hex(&parse(r#"{"id": "9007199254740992"}"#)),
        "the same integers as strings stay distinct"
    );
}

#[test]
fn non_finite_numbers_cannot_reach_the_canonicaliser() {
    // Appendix B's NaN and Infinity rows must be rejected. serde_json refuses
    // to hold them, so they are rejected before canonicalisation: a literal
    // overflowing a double fails to parse, and `Number::from_f64` refuses.
    assert!(serde_json::from_str::<Value>("1e400").is_err());
    assert!(serde_json::from_str::<Value>("-1e400").is_err());
    assert!(serde_json::from_str::<Value>("NaN").is_err());
    assert!(serde_json::from_str::<Value>("Infinity").is_err());
    for bits in [0x7fff_ffff_ffff_ffff_u64, 0x7ff0_0000_0000_0000] {
        assert!(Number::from_f64(f64::from_bits(bits)).is_none());
    }
    // Beware: `Value::from(f64::NAN)` (and `json!`) silently make `null`.
    assert_eq!(canonical(&Value::from(f64::NAN)), "null");
    // Underflow is not an error: the nearest double is zero.
    assert_eq!(canonical_text("1e-400"), "0");
}

// ---- strings ---------------------------------------------------------------

#[test]
fn control_characters_are_escaped_with_short_forms_or_lowercase_hex() {
    for code in 0u32..0x20 {
        let character = char::from_u32(code).expect("below 0x20 is a char");
        let expected = match character {
            '\u{8}' => "\"\\b\"".to_owned(),
            '\t' => "\"\\t\"".to_owned(),
            '\n' => "\"\\n\"".to_owned(),
            '\u{c}' => "\"\\f\"".to_owned(),
            '\r' => "\"\\r\"".to_owned(),
            _ => format!("\"\\u{code:04x}\""),
        };
        assert_eq!(
            canonical(&Value::String(character.to_string())),
            expected,
            "U+{code:04X}"
        );
    }
    // Upper-case hex in the input is lower-case in the output.
    assert_eq!(canonical_text(r#""\u001F\u001b""#), r#""\u001f\u001b""#);
}

#[test]
fn only_quote_backslash_and_controls_are_escaped() {
    let cases = [
        (r#""\u20ac""#, "\"\u{20ac}\""),
        (r#""\/""#, r#""/""#),
        (r#""a/b""#, r#""a/b""#),
        (r#""\"""#, r#""\"""#),
        (r#""\\""#, r#""\\""#),
        (r#""\u0041\u00e9""#, "\"A\u{e9}\""),
        // DEL and the C1 controls are not JSON control characters.
        (r#""\u007f\u0080\u009f""#, "\"\u{7f}\u{80}\u{9f}\""),
        // Line and paragraph separators stay literal (JSON.stringify too).
        (r#""\u2028\u2029""#, "\"\u{2028}\u{2029}\""),
        // A surrogate pair becomes the one character, in UTF-8.
        (r#""\ud83d\ude00""#, "\"\u{1f600}\""),
        (r#""\uFEFF""#, "\"\u{feff}\""),
    ];
    for (text, expected) in cases {
        assert_eq!(canonical_text(text), expected, "input {text}");
    }
}

#[test]
fn keys_are_escaped_like_strings_and_sorted_unescaped() {
    // "\n" (0x0a) sorts before "A" (0x41) although its escape "\\n" starts
    // with a backslash (0x5c), which would sort after "A".
    let text = r#"{"A": 1, "\n": 2, "\u0001": 3}"#;
    assert_eq!(canonical_text(text), r#"{"\u0001":3,"\n":2,"A":1}"#);
}

#[test]
fn lone_surrogates_are_rejected_when_parsing() {
    // RFC 8785 §3.2.2.2 requires them to be rejected; a Rust String cannot
    // hold them, so serde_json refuses them at parse time.
    assert!(serde_json::from_str::<Value>(r#""\ud800""#).is_err());
    assert!(serde_json::from_str::<Value>(r#""\udc00x""#).is_err());
}

// ---- digests and the CanonicalJson wrapper ---------------------------------

#[test]
fn the_digest_is_sha256_of_the_canonical_text_in_lowercase_hex() {
    let value = parse(r#"{ "b" : 2, "a" : [1.0, "x"] }"#);
    let json = CanonicalJson::new("test", &value).expect("within the limits");
    assert_eq!(json.as_str(), r#"{"a":[1,"x"],"b":2}"#);
    let expected = hex::encode(Sha256::digest(json.as_str().as_bytes()));
    assert_eq!(json.digest().as_hex(), expected);
    assert_eq!(digest_hex(&value), expected);
    // A known answer: SHA-256("{}").
    assert_eq!(
        digest_hex(&Value::Object(Map::new())),
        "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    );
}

#[test]
fn equal_digests_for_equal_json_and_distinct_for_distinct_json() {
    let a = parse(r#"{"tool":"transfer","amount":10.50,"to":"bob"}"#);
    let b = parse("{\n  \"to\": \"bob\",\n  \"amount\": 1.05e1,\n  \"tool\": \"transfer\"\n}");
    let c = parse(r#"{"tool":"transfer","amount":10.51,"to":"bob"}"#);
    assert_eq!(digest_hex(&a), digest_hex(&b));
    assert_ne!(digest_hex(&a), digest_hex(&c));
}

#[test]
fn values_over_the_limits_are_invalid_requests() {
    let mut deep = Value::Null;
    for _ in 0..agentgate_core::limits::MAX_JSON_DEPTH {
        deep = Value::Array(vec![deep]);
    }
    // MAX_JSON_DEPTH arrays around a scalar: exactly the limit.
    assert!(canonicalize("payload", &deep).is_ok());
    let deep = Value::Array(vec![deep]);
    let error = canonicalize("payload", &deep).expect_err("one level too deep");
    assert_eq!(error.kind(), ErrorKind::InvalidRequest);
    assert!(error.to_string().contains("payload"), "{error}");
    let error = digest("args", &deep).expect_err("one level too deep");
    assert_eq!(error.kind(), ErrorKind::InvalidRequest);
}

// ---- properties ------------------------------------------------------------

/// A small deterministic generator (SplitMix64) for the choices a rendering
/// makes, so a failing case replays from the seed proptest prints.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: usize) -> usize {
        let bound = u64::try_from(bound).expect("a usize fits in a u64");
        usize::try_from(self.next() % bound).expect("below a usize bound")
    }

    fn one_in(&mut self, odds: usize) -> bool {
        self.below(odds) == 0
    }
}

/// Writes `value` as JSON text with object members in a shuffled order,
/// random whitespace between tokens, and random but equivalent spellings of
/// numbers and string escapes.
struct Scrambler {
    choices: Choices,
    text: String,
}

impl Scrambler {
    fn render(value: &Value, seed: u64) -> String {
        let mut scrambler = Self {
            choices: Choices(seed),
            text: String::new(),
        };
        scrambler.whitespace();
        scrambler.value(value);
        scrambler.whitespace();
        scrambler.text
    }

    fn whitespace(&mut self) {
        const SPACES: [char; 4] = [' ', '\t', '\n', '\r'];
        for _ in 0..self.choices.below(3) {
            self.text.push(SPACES[self.choices.below(SPACES.len())]);
        }
    }

    fn value(&mut self, value: &Value) {
        match value {
            Value::Null => self.text.push_str("null"),
            Value::Bool(flag) => self.text.push_str(if *flag { "true" } else { "false" }),
            Value::Number(number) => self.number(number),
            Value::String(string) => self.string(string),
            Value::Array(items) => {
                self.text.push('[');
                for (index, item) in items.iter().enumerate() {
                    self.whitespace();
                    if index > 0 {
                        self.text.push(',');
                        self.whitespace();
                    }
                    self.value(item);
                }
                self.whitespace();
                self.text.push(']');
            }
            Value::Object(map) => {
                let mut members: Vec<(&String, &Value)> = map.iter().collect();
                // Fisher-Yates.
                for last in (1..members.len()).rev() {
                    let pick = self.choices.below(last + 1);
                    members.swap(last, pick);
                }
                self.text.push('{');
                for (index, (key, member)) in members.into_iter().enumerate() {
                    self.whitespace();
                    if index > 0 {
                        self.text.push(',');
                        self.whitespace();
                    }
                    self.string(key);
                    self.whitespace();
                    self.text.push(':');
                    self.whitespace();
                    self.value(member);
                }
                self.whitespace();
                self.text.push('}');
            }
        }
    }

    fn number(&mut self, number: &Number) {
        let spelling = if let Some(integer) = number.as_i64() {
            match self.choices.below(4) {
                0 => format!("{integer}"),
                1 => format!("{integer}.0"),
                2 => format!("{integer}e0"),
                // JSON forbids leading zeros, so zero has its own spelling.
                _ if integer == 0 => "0.0e5".to_owned(),
                _ => format!("{integer}00E-2"),
            }
        } else if let Some(integer) = number.as_u64() {
            match self.choices.below(3) {
                0 => format!("{integer}"),
                1 => format!("{integer}.000"),
                _ => format!("{integer}E+0"),
            }
        } else {
            let double = number.as_f64().expect("a JSON number is an f64");
            // Rust prints the shortest digits that read back as the same
            // double, positional or in exponent form; serde_json uses ryu.
            match self.choices.below(4) {
                0 => format!("{double}"),
                1 => format!("{double:e}"),
                2 => format!("{double:E}"),
                _ => number.to_string(),
            }
        };
        self.text.push_str(&spelling);
    }

    fn string(&mut self, string: &str) {
        self.text.push('"');
        for character in string.chars() {
            match character {
                '"' if self.choices.one_in(2) => self.text.push_str("\\\""),
                '\\' if self.choices.one_in(2) => self.text.push_str("\\\\"),
                '/' if self.choices.one_in(2) => self.text.push_str("\\/"),
                '\u{8}' if self.choices.one_in(2) => self.text.push_str("\\b"),
                '\t' if self.choices.one_in(2) => self.text.push_str("\\t"),
                '\n' if self.choices.one_in(2) => self.text.push_str("\\n"),
                '\u{c}' if self.choices.one_in(2) => self.text.push_str("\\f"),
                '\r' if self.choices.one_in(2) => self.text.push_str("\\r"),
                '"' | '\\' | '\u{0}'..='\u{1f}' => self.unicode_escape(character),
                _ if self.choices.one_in(4) => self.unicode_escape(character),
                _ => self.text.push(character),
            }
        }
        self.text.push('"');
    }

    /// `\uXXXX`, as a surrogate pair beyond the BMP, in random hex case.
    fn unicode_escape(&mut self, character: char) {
        let mut units = [0u16; 2];
        for unit in character.encode_utf16(&mut units) {
            let escape = if self.choices.one_in(2) {
                format!("\\u{unit:04x}")
            } else {
                format!("\\u{unit:04X}")
            };
            self.text.push_str(&escape);
        }
    }
}

/// Equality in RFC 8785's data model: numbers are IEEE-754 doubles (so `5`,
/// `5.0` and `5e0` are one number, `-0` is `0`, and integers beyond 2^53
/// that round to one double are one number); everything else is structural.
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(xs), Value::Array(ys)) => {
            xs.len() == ys.len() && xs.iter().zip(ys).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(xs), Value::Object(ys)) => {
            xs.len() == ys.len()
                && xs
                    .iter()
                    .all(|(key, x)| ys.get(key).is_some_and(|y| same_json(x, y)))
        }
        _ => a == b,
    }
}

fn any_text(max_chars: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        // Any character: controls, escapes, surrogate pairs, U+FFFF.
        prop::collection::vec(any::<char>(), 0..max_chars).prop_map(String::from_iter),
        // A tiny alphabet, so two generated values often collide.
        prop::collection::vec(prop::sample::select(vec!['a', 'b', '"', '\n']), 0..3)
            .prop_map(String::from_iter),
    ]
}

fn any_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("JSON has no NaN or infinity", |double| {
            Number::from_f64(double).map(Value::Number)
        }),
        // The same small numbers as integers and as doubles, and minus zero.
        (-2i64..3).prop_map(Value::from),
        (-2i64..3).prop_map(|integer| Value::from(integer as f64)),
        Just(Value::from(-0.0_f64)),
        // 2^53 and 2^53 + 1: one double.
        prop::sample::select(vec![9_007_199_254_740_992_u64, 9_007_199_254_740_993])
            .prop_map(Value::from),
    ]
}

fn any_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any_number(),
        any_text(8).prop_map(Value::String),
    ]
}

/// Arbitrary JSON at most five levels deep, about 48 nodes.
fn any_json() -> impl Strategy<Value = Value> {
    any_leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any_text(6), inner, 0..6)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

/// Replaces the node at pre-order position `target` (counting from `*seen`).
fn replace_node(value: &mut Value, target: usize, seen: &mut usize, with: &Value) -> bool {
    if *seen == target {
        *value = with.clone();
        return true;
    }
    *seen += 1;
    match value {
        Value::Array(items) => items
            .iter_mut()
            .any(|item| replace_node(item, target, seen, with)),
        Value::Object(map) => map
            .values_mut()
            .any(|member| replace_node(member, target, seen, with)),
        _ => false,
    }
}

fn node_count(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(node_count).sum(),
        Value::Object(map) => map.values().map(node_count).sum(),
        _ => 0,
    }
}

/// A value and a copy with one node replaced: often different, sometimes
/// the same (the replacement may equal what it replaced).
fn value_and_mutant() -> impl Strategy<Value = (Value, Value)> {
    (any_json(), any_leaf(), any::<u64>()).prop_map(|(original, leaf, seed)| {
        let mut mutant = original.clone();
        let target = Choices(seed).below(node_count(&original));
        assert!(replace_node(&mut mutant, target, &mut 0, &leaf));
        (original, mutant)
    })
}

/// The same JSON with every number held the other way: integers as doubles,
/// integral doubles as integers, zero as minus zero. Equal in the RFC's data
/// model, yet a different `Value` wherever it holds a number.
fn respell_numbers(value: &Value) -> Value {
    match value {
        Value::Number(number) => {
            let double = number.as_f64().expect("a JSON number is an f64");
            if number.is_f64() && double == 0.0 {
                Value::from(-double)
            } else if number.is_f64() && double.fract() == 0.0 && double.abs() < 9.0e18 {
                // Integral and well inside i64: the cast is exact.
                Value::from(double as i64)
            } else {
                // `as f64` is how the RFC's data model reads any integer.
                Value::from(double)
            }
        }
        Value::Array(items) => Value::Array(items.iter().map(respell_numbers).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, member)| (key.clone(), respell_numbers(member)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn reparse(text: &str) -> Result<Value, TestCaseError> {
    serde_json::from_str(text)
        .map_err(|e| TestCaseError::fail(format!("rendered text {text:?} is not JSON: {e}")))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn key_order_whitespace_and_spelling_never_change_the_digest(
        value in any_json(),
        seed in any::<u64>(),
    ) {
        let expected = digest_hex(&value);
        let scrambled = Scrambler::render(&value, seed);
        prop_assert_eq!(digest_hex(&reparse(&scrambled)?), expected.clone(), "{}", scrambled);
        let compact = serde_json::to_string(&value).expect("a Value serialises");
        prop_assert_eq!(digest_hex(&reparse(&compact)?), expected.clone());
        let pretty = serde_json::to_string_pretty(&value).expect("a Value serialises");
        prop_assert_eq!(digest_hex(&reparse(&pretty)?), expected);
    }

    #[test]
    fn canonical_text_is_a_fixed_point(value in any_json()) {
        let once = canonical(&value);
        let reparsed = reparse(&once)?;
        prop_assert!(same_json(&reparsed, &value), "{} read back as {:?}", once, reparsed);
        prop_assert_eq!(canonical(&reparsed), once);
    }

    #[test]
    fn values_differ_exactly_when_their_canonical_texts_differ(
        (a, b) in prop_oneof![
            value_and_mutant(),
            any_json().prop_map(|value| {
                let respelled = respell_numbers(&value);
                (value, respelled)
            }),
            (any_json(), any_json()),
        ],
    ) {
        let same = same_json(&a, &b);
        let (text_a, text_b) = (canonical(&a), canonical(&b));
        prop_assert_eq!(text_a == text_b, same, "{} vs {}", text_a, text_b);
        prop_assert_eq!(digest_hex(&a) == digest_hex(&b), same);
    }
}
