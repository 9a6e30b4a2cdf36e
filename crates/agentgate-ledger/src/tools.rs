//! The agent's two tools: their JSON schemas (what a model is shown) and the
//! validation of their arguments (pure; errors are messages for the model).
//!
//! - `list_categories {type}`: read-only.
//! - `create_transaction {type, amount, category_name?, note?, occur_date?}`:
//!   books one entry; its insert commits with the tool's success mark.
//! - `search_documents {query}`: read-only, the user's uploaded documents.

use serde::Serialize;
use serde_json::{json, Value};

use crate::category::{self, MatchKind};
use crate::date::{self, Date};
use crate::limits::MAX_NOTE_CHARS;
use crate::money;
use crate::records::{Category, EntryType, NewEntry};

/// The read-only category lookup.
pub const LIST_CATEGORIES: &str = "list_categories";

/// The booking tool.
pub const CREATE_TRANSACTION: &str = "create_transaction";

/// The read-only search of the user's uploaded documents.
pub const SEARCH_DOCUMENTS: &str = "search_documents";

/// The longest query `search_documents` takes, in characters.
pub const MAX_DOCUMENT_QUERY_CHARS: usize = 500;

/// The query of a `search_documents` call.
///
/// # Errors
/// A message for the model: not an object, no query, an empty or long one.
pub fn search_documents_args(args: &Value) -> Result<String, String> {
    let args = object(args)?;
    match args.get("query") {
        Some(Value::String(query))
            if !query.trim().is_empty() && query.chars().count() <= MAX_DOCUMENT_QUERY_CHARS =>
        {
            Ok(query.trim().to_owned())
        }
        _ => Err(format!(
            "query must be a string of 1 to {MAX_DOCUMENT_QUERY_CHARS} characters"
        )),
    }
}

/// A tool as shown to a model (OpenAI's `function` shape).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolSpec {
    /// The tool's name.
    pub name: &'static str,
    /// What it does, for the model.
    pub description: &'static str,
    /// JSON Schema of its arguments.
    pub parameters: Value,
}

/// Both tools' specs.
pub fn specs() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: LIST_CATEGORIES,
            description: "List the ledger's categories of one type, with their synonyms.",
            parameters: json!({
                "type": "object",
                "properties": {"type": {"type": "string", "enum": ["income", "expense"]}},
                "required": ["type"],
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: CREATE_TRANSACTION,
            description: "Book one income or expense entry in the user's ledger. \
                          Call once per entry. Amounts above the confirmation threshold \
                          are held until the user approves them.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["income", "expense"]},
                    "amount": {"type": "number", "description": "in yuan, above 0, at most two decimals"},
                    "category_name": {"type": "string", "description": "a category name from list_categories, or the user's word for it"},
                    "note": {"type": "string", "description": "the user's words for this entry"},
                    "occur_date": {"type": "string", "description": "YYYY-MM-DD, or today / yesterday / 今天 / 昨天 / 前天; default today"}
                },
                "required": ["type", "amount"],
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: SEARCH_DOCUMENTS,
            description: "Search the receipts and policies the user uploaded. Returns the \
                          closest passages with their file name; cite the file when you answer.",
            parameters: json!({
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look for"}},
                "required": ["query"],
                "additionalProperties": false
            }),
        },
    ]
}

fn object(args: &Value) -> Result<&serde_json::Map<String, Value>, String> {
    args.as_object()
        .ok_or_else(|| format!("arguments must be a JSON object, got {args}"))
}

fn entry_type(args: &serde_json::Map<String, Value>) -> Result<EntryType, String> {
    match args.get("type") {
        Some(Value::String(text)) => EntryType::parse(text)
            .ok_or_else(|| format!("type must be \"income\" or \"expense\", got {text:?}")),
        Some(other) => Err(format!(
            "type must be \"income\" or \"expense\", got {other}"
        )),
        None => Err("type is required: \"income\" or \"expense\"".into()),
    }
}

fn optional_text<'a>(
    args: &'a serde_json::Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, String> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.as_str()).filter(|t| !t.trim().is_empty())),
        Some(other) => Err(format!("{key} must be a string, got {other}")),
    }
}

/// Validates `list_categories`'s arguments: the type to list.
///
/// # Errors
/// A message for the model when `type` is missing or not income/expense.
pub fn list_categories_args(args: &Value) -> Result<EntryType, String> {
    entry_type(object(args)?)
}

/// A validated `create_transaction`: the entry and how its category was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidCreate {
    /// The entry to book.
    pub entry: NewEntry,
    /// How the category was resolved.
    pub matched_by: MatchKind,
}

/// Validates `create_transaction`'s arguments, resolves the category among
/// `categories` and the date against `today`.
///
/// # Errors
/// A message for the model: bad type, amount ≤ 0 or malformed, a date it
/// cannot read, a non-string text field, or no category of the type.
pub fn create_transaction_args(
    args: &Value,
    categories: &[Category],
    today: Date,
) -> Result<ValidCreate, String> {
    let args = object(args)?;
    let kind = entry_type(args)?;
    let amount_cents = money::parse_amount(args.get("amount").unwrap_or(&Value::Null))?;
    let category_hint = optional_text(args, "category_name")?;
    let note = optional_text(args, "note")?;
    let occur_date = date::resolve(optional_text(args, "occur_date")?, today)?;
    let (category, matched_by) = category::resolve(categories, kind, &[category_hint, note])
        .ok_or_else(|| format!("the ledger has no {} categories", kind.as_str()))?;
    let note: String = note
        .or(category_hint)
        .unwrap_or_default()
        .trim()
        .chars()
        .take(MAX_NOTE_CHARS)
        .collect();
    Ok(ValidCreate {
        entry: NewEntry {
            kind,
            amount_cents,
            category: category.name.clone(),
            note,
            occur_date: occur_date.to_string(),
        },
        matched_by,
    })
}

/// The canonical arguments of an entry, as a confirmation turn books it:
/// resolved category and date, amount in cents.
pub fn canonical_create_args(entry: &NewEntry) -> Value {
    json!({
        "type": entry.kind.as_str(),
        "amount": money::format_cents(entry.amount_cents),
        "category_name": entry.category,
        "note": entry.note,
        "occur_date": entry.occur_date,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::category::DEFAULT_CATEGORIES;

    fn categories() -> Vec<Category> {
        DEFAULT_CATEGORIES
            .iter()
            .map(|s| Category {
                kind: s.kind,
                name: s.name.into(),
                synonyms: s.synonyms.iter().map(|w| (*w).to_owned()).collect(),
                is_default: s.is_default,
            })
            .collect()
    }

    fn today() -> Date {
        Date::new(2024, 5, 1).expect("date")
    }

    #[test]
    fn a_valid_call_resolves_category_date_and_cents() {
        let valid = create_transaction_args(
            &json!({"type": "expense", "amount": 35, "category_name": "吃粉", "occur_date": "昨天"}),
            &categories(),
            today(),
        )
        .expect("valid");
        assert_eq!(valid.entry.category, "餐饮");
        assert_eq!(valid.entry.amount_cents, 3500);
        assert_eq!(valid.entry.occur_date, "2024-04-30");
        assert_eq!(valid.entry.note, "吃粉");
        assert_eq!(valid.matched_by, MatchKind::Synonym);
    }

    #[test]
    fn invalid_calls_get_a_message_not_a_panic() {
        let cats = categories();
        let check = |args: Value, needle: &str| {
            let error = create_transaction_args(&args, &cats, today()).expect_err("invalid");
            assert!(error.contains(needle), "{error} should mention {needle}");
        };
        check(json!({"type": "expense", "amount": 0}), "greater than 0");
        check(
            json!({"type": "spend", "amount": 5}),
            "income\" or \"expense",
        );
        check(json!({"amount": 5}), "type is required");
        check(
            json!({"type": "expense", "amount": 5, "occur_date": "2024-13-45"}),
            "not a date",
        );
        check(
            json!({"type": "expense", "amount": 5, "note": 7}),
            "note must be a string",
        );
        check(json!("not an object"), "JSON object");
        assert!(list_categories_args(&json!({"type": "both"})).is_err());
        assert_eq!(
            list_categories_args(&json!({"type": "income"})),
            Ok(EntryType::Income)
        );
    }

    #[test]
    fn canonical_args_validate_to_the_same_entry() {
        let entry = create_transaction_args(
            &json!({"type": "expense", "amount": 5000, "category_name": "衣服", "note": "买衣服"}),
            &categories(),
            today(),
        )
        .expect("valid")
        .entry;
        let again = create_transaction_args(&canonical_create_args(&entry), &categories(), today())
            .expect("valid")
            .entry;
        assert_eq!(entry, again);
    }
}
