//! The records' validation and fingerprints.

use serde_json::json;

use super::*;
use crate::limits::{MAX_JSON_BYTES, MAX_JSON_DEPTH};

#[test]
fn the_streams_own_event_names_are_reserved() {
    for name in RESERVED_EVENT_NAMES {
        let refused = NewEvent::new(name, &json!({})).unwrap_err();
        assert!(refused.to_string().contains("reserved"), "{refused}");
    }
    assert!(NewEvent::new("ending", &json!({})).is_ok());
    assert!(NewEvent::new("token", &json!({})).is_ok());
}

fn begin(payload: &Value) -> Result<BeginCommand> {
    BeginCommand::new(
        UserId::new("u").unwrap(),
        SessionId::new("s").unwrap(),
        ClientRequestId::new("r").unwrap(),
        payload,
        None,
    )
}

#[test]
fn a_payload_at_the_json_limits_begins_and_one_past_them_does_not() {
    // The fingerprint wraps the payload in an object; the limits must
    // apply to the payload alone (schema fuzzing found 63 levels
    // accepted where 64 were documented).
    let nested = |levels: usize| (0..levels).fold(json!(1), |inner, _| json!([inner]));
    assert!(begin(&nested(MAX_JSON_DEPTH)).is_ok());
    let deep = begin(&nested(MAX_JSON_DEPTH + 1)).unwrap_err();
    assert_eq!(deep.kind(), crate::ErrorKind::InvalidRequest);
    // A string of n bytes is n + 2 canonical bytes.
    assert!(begin(&json!("a".repeat(MAX_JSON_BYTES - 2))).is_ok());
    let large = begin(&json!("a".repeat(MAX_JSON_BYTES - 1))).unwrap_err();
    assert_eq!(large.kind(), crate::ErrorKind::InvalidRequest);
}

#[test]
fn the_fingerprint_is_the_digest_of_payload_and_confirmation_as_before() {
    // Stored turns keep their fingerprints: a repeat after an upgrade
    // must still match.
    let payload = json!({"text": "记账", "n": [1, 2.5]});
    let command = begin(&payload).unwrap();
    let wrapped = json!({"payload": payload, "confirmation": null});
    assert_eq!(
        command.fingerprint,
        crate::canonical::digest("payload", &wrapped).unwrap()
    );
    assert_eq!(
        command.fingerprint.as_hex(),
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            r#"{"confirmation":null,"payload":{"n":[1,2.5],"text":"记账"}}"#.as_bytes()
        ))
    );
}
