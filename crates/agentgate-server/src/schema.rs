//! The OpenAPI schemas of the values the engine validates itself: ids, the
//! lease token and the JSON a caller hands over (payload, args, results,
//! errors, responses, pending actions).
//!
//! Each states exactly what the engine enforces, from the same constants
//! (`agentgate::limits`), so a request valid by the document is never refused
//! as malformed, and one the server refuses as malformed is invalid by the
//! document. Where JSON Schema cannot say a rule (nesting depth, canonical
//! size, a number's spelling), the schema's description says it.

use std::borrow::Cow;

use agentgate::canonical::MAX_SAFE_INTEGER;
use agentgate::limits::{MAX_ID_CHARS, MAX_JSON_BYTES, MAX_JSON_DEPTH};
use serde_json::json;
use utoipa::openapi::extensions::Extensions;
use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaType, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

/// The characters of an id as [`agentgate::UserId`] and its siblings check
/// them: none of Unicode category Cc (U+0000–U+001F, U+007F–U+009F).
/// ECMA-262 syntax, as JSON Schema's `pattern` is. The length (1 to
/// [`MAX_ID_CHARS`]) is `minLength`/`maxLength`, which count code points,
/// where a quantifier in a non-Unicode ECMA-262 engine would count UTF-16
/// units.
pub const ID_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]*$";

/// The characters of a lease token as
/// [`agentgate_core::ids::LeaseToken::parse`] checks them: printable ASCII,
/// no space. The length (1 to [`MAX_ID_CHARS`]) is `minLength`/`maxLength`.
pub const LEASE_TOKEN_PATTERN: &str = r"^[!-~]*$";

/// The OpenAPI schema `Id`: a user, session, client request, tool, turn or
/// execution id.
pub struct Id;

impl PartialSchema for Id {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(MAX_ID_CHARS))
            .pattern(Some(ID_PATTERN))
            .description(Some(format!(
                "1–{MAX_ID_CHARS} characters (Unicode code points, as `maxLength` counts; \
                 up to {} bytes of UTF-8), none a control character (U+0000–U+001F, \
                 U+007F–U+009F). Compared exactly, byte by byte.",
                4 * MAX_ID_CHARS
            )))
            .into()
    }
}

impl ToSchema for Id {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Id")
    }
}

/// The OpenAPI schema `LeaseToken`: the `Lease-Token` header's value.
pub struct LeaseTokenText;

impl PartialSchema for LeaseTokenText {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(MAX_ID_CHARS))
            .pattern(Some(LEASE_TOKEN_PATTERN))
            .description(Some(format!(
                "The `lease_token` a grant returned (`lt_` and 64 hex digits). Any other \
                 value of 1–{MAX_ID_CHARS} printable ASCII characters without spaces is \
                 answered `lease_lost`; anything else is `invalid_request`."
            )))
            .into()
    }
}

impl ToSchema for LeaseTokenText {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("LeaseToken")
    }
}

/// The OpenAPI schema `JsonValue`: any I-JSON value (RFC 7493) within the
/// engine's limits, recursively: numbers within ±(2^53−1).
///
/// Written without `type`, `anyOf` or `additionalProperties` at its top, as
/// keywords that each apply to one kind of value only: `minimum`/`maximum`
/// to numbers, `items` to arrays, and `additionalProperties` (through
/// `if` the value is an object, `then`) to objects. A validator reads exactly the rule
/// the engine applies, at every depth; a client generator, which reads
/// `type` and the composition keywords, sees "any JSON" (Python `Any`,
/// TypeScript `unknown`). The earlier `anyOf` of the four kinds, each
/// recursing through a `$ref` to itself, was the same rule but broke both
/// generators issue 15 names: openapi-python-client cannot build a union
/// that refers to itself and dropped every operation with a JSON field
/// (begin, tool claim, the endings), and openapi-typescript wrote a type
/// that TypeScript rejects as referring to itself (TS2502).
///
/// utoipa's schema types hold neither `items` on an untyped schema nor
/// `if`/`then`; they go in through the schema's extensions, whose map (unlike
/// its builder, which prefixes `x-`) serialises any key as written. (utoipa's
/// own deserialiser would drop them; nothing reads the document back through
/// utoipa's types.)
pub struct JsonValue;

/// The description of [`JsonValue`]: the limits no keyword states.
fn json_value_description() -> String {
    format!(
        "Any JSON value, as I-JSON (RFC 7493): every number within ±(2^53−1) and exact \
         as an IEEE 754 double (a literal with more precision than a double, such as \
         `0.10000000000000000001` or `1e-400`, is refused), no duplicate member names, \
         no lone surrogates in strings. Limits the schema cannot state: nested at most \
         {MAX_JSON_DEPTH} arrays and objects deep (a scalar is depth 0, `[]` depth 1), \
         and at most {MAX_JSON_BYTES} bytes in RFC 8785 canonical form. Breaking any \
         of these is `invalid_request` naming the member."
    )
}

/// The largest magnitude of a JSON number the engine accepts.
fn max_safe_number() -> i64 {
    i64::try_from(MAX_SAFE_INTEGER).expect("2^53 - 1 fits an i64")
}

impl PartialSchema for JsonValue {
    fn schema() -> RefOr<Schema> {
        let itself = json!({ "$ref": format!("#/components/schemas/{}", JsonValue::name()) });
        let keywords = Extensions::from_iter([
            ("items", itself.clone()),
            ("if", json!({ "type": "object" })),
            ("then", json!({ "additionalProperties": itself })),
        ]);
        ObjectBuilder::new()
            .schema_type(SchemaType::AnyValue)
            .minimum(Some(-max_safe_number()))
            .maximum(Some(max_safe_number()))
            .description(Some(json_value_description()))
            .extensions(Some(keywords))
            .into()
    }
}

impl ToSchema for JsonValue {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("JsonValue")
    }
}

#[cfg(test)]
mod tests {
    //! The schemas say what the engine's checks say, character by character:
    //! the patterns are compiled (ECMA-262's `\uXXXX` and ranges mean the same
    //! in the `regex` crate) and, with the lengths, compared with the
    //! engine's own constructors.
    #![allow(clippy::unwrap_used)]
    use agentgate::UserId;
    use agentgate_core::ids::LeaseToken;
    use regex::Regex;

    use super::*;

    /// A validator of a string schema built above: its pattern compiled,
    /// its lengths counted in characters as JSON Schema counts them.
    fn validator(schema: RefOr<Schema>) -> impl Fn(&str) -> bool {
        let RefOr::T(Schema::Object(object)) = schema else {
            panic!("a string schema")
        };
        let pattern = Regex::new(object.pattern.as_deref().unwrap()).unwrap();
        move |text| {
            let count = text.chars().count();
            object.min_length.is_none_or(|min| count >= min)
                && object.max_length.is_none_or(|max| count <= max)
                && pattern.is_match(text)
        }
    }

    /// One character of every 7 of all of Unicode, and all of Latin-1.
    fn characters() -> impl Iterator<Item = char> {
        (0..=0x10_FFFF_u32)
            .step_by(7)
            .chain(0..=0x17F)
            .filter_map(char::from_u32)
    }

    #[test]
    fn the_id_schema_is_exactly_the_engines_id_check() {
        let valid = validator(Id::schema());
        let mut accepted = 0;
        for c in characters() {
            // At the length limit only for some: debug-mode regexes are slow.
            let long = (u32::from(c) % 61 == 0).then(|| c.to_string().repeat(MAX_ID_CHARS));
            for text in [c.to_string(), format!("a{c}")].into_iter().chain(long) {
                let engine = UserId::new(text.clone()).is_ok();
                assert_eq!(valid(&text), engine, "U+{:04X}", u32::from(c));
                accepted += usize::from(engine);
            }
        }
        assert!(accepted > 300_000, "{accepted}");
        for text in [
            String::new(),
            "x".repeat(MAX_ID_CHARS + 1),
            "中".repeat(MAX_ID_CHARS + 1),
        ] {
            assert!(!valid(&text));
            assert!(UserId::new(text).is_err());
        }
    }

    #[test]
    fn the_lease_token_schema_is_exactly_the_engines_token_check() {
        let valid = validator(LeaseTokenText::schema());
        for c in characters() {
            let long = (u32::from(c) % 61 == 0).then(|| c.to_string().repeat(MAX_ID_CHARS));
            for text in [c.to_string()].into_iter().chain(long) {
                assert_eq!(
                    valid(&text),
                    LeaseToken::parse(text.clone()).is_ok(),
                    "U+{:04X}",
                    u32::from(c)
                );
            }
        }
        for text in [String::new(), "x".repeat(MAX_ID_CHARS + 1)] {
            assert!(!valid(&text));
            assert!(LeaseToken::parse(text).is_err());
        }
        assert!(valid(LeaseToken::generate().expose_secret()));
    }
}
