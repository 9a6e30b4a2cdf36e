//! The default categories, their synonyms, and category resolution.
//!
//! Resolution (docs/protocol.md §11) of a hint (the model's `category_name`, else the
//! note) within the entry's type: exact name → exact synonym → substring (a
//! name or synonym inside the hint, longest wins; or the hint inside a name)
//! → the type's default category. Pure: the caller reads the categories.

use crate::limits::MAX_CATEGORY_HINT_CHARS;
use crate::records::{Category, EntryType};

/// A category to seed.
#[derive(Clone, Copy, Debug)]
pub struct Seed {
    /// Income or expense.
    pub kind: EntryType,
    /// The name.
    pub name: &'static str,
    /// Its synonyms.
    pub synonyms: &'static [&'static str],
    /// Whether unmatched entries of this type land here.
    pub is_default: bool,
}

const fn expense(name: &'static str, synonyms: &'static [&'static str]) -> Seed {
    Seed {
        kind: EntryType::Expense,
        name,
        synonyms,
        is_default: false,
    }
}

const fn income(name: &'static str, synonyms: &'static [&'static str]) -> Seed {
    Seed {
        kind: EntryType::Income,
        name,
        synonyms,
        is_default: false,
    }
}

/// A default category's name in an English reply (the page's own table,
/// `CATEGORIES_EN` in `crates/agentgate-app/assets/i18n.js`, is held to
/// this one by a test); a category a user made keeps its name.
pub fn english_name(name: &str) -> &str {
    match name {
        "餐饮" => "Food",
        "交通" => "Transport",
        "购物" => "Shopping",
        "娱乐" => "Entertainment",
        "居住" => "Housing",
        "医疗" => "Health",
        "教育" => "Education",
        "通讯" => "Phone",
        "工资" => "Salary",
        "奖金" => "Bonus",
        "理财" => "Investments",
        "红包" => "Red packets",
        "报销" => "Reimbursements",
        "其他" => "Other",
        other => other,
    }
}

/// The categories every ledger starts with, in display order. Seeding is
/// idempotent: a category that exists (same type and name) is left alone.
pub const DEFAULT_CATEGORIES: &[Seed] = &[
    expense(
        "餐饮",
        &[
            "午饭",
            "午餐",
            "早饭",
            "早餐",
            "晚饭",
            "晚餐",
            "夜宵",
            "宵夜",
            "外卖",
            "吃饭",
            "吃粉",
            "米粉",
            "粉",
            "面条",
            "吃面",
            "饭",
            "奶茶",
            "咖啡",
            "零食",
            "水果",
            "聚餐",
            "食堂",
            "饮料",
            "lunch",
            "dinner",
            "breakfast",
            "food",
            "meal",
            "coffee",
            "restaurant",
            "snack",
            "takeout",
        ],
    ),
    expense(
        "交通",
        &[
            "打车",
            "出租车",
            "滴滴",
            "地铁",
            "公交",
            "加油",
            "停车",
            "高铁",
            "火车",
            "机票",
            "车费",
            "taxi",
            "uber",
            "subway",
            "metro",
            "bus",
            "fuel",
            "gas",
            "parking",
            "train",
            "flight",
        ],
    ),
    expense(
        "购物",
        &[
            "超市",
            "淘宝",
            "京东",
            "衣服",
            "鞋",
            "日用品",
            "网购",
            "买菜",
            "shopping",
            "clothes",
            "supermarket",
            "groceries",
        ],
    ),
    expense(
        "娱乐",
        &[
            "电影",
            "游戏",
            "唱歌",
            "演唱会",
            "旅游",
            "门票",
            "movie",
            "game",
            "cinema",
            "concert",
            "netflix",
        ],
    ),
    expense(
        "居住",
        &[
            "房租",
            "水电",
            "电费",
            "水费",
            "燃气",
            "物业",
            "宽带",
            "rent",
            "utilities",
            "electricity",
            "internet",
        ],
    ),
    expense(
        "医疗",
        &[
            "医院", "看病", "买药", "药", "挂号", "体检", "doctor", "hospital", "medicine",
            "pharmacy",
        ],
    ),
    expense(
        "教育",
        &[
            "学费", "课程", "培训", "买书", "书", "tuition", "course", "book",
        ],
    ),
    expense("通讯", &["话费", "手机费", "流量", "phone bill", "mobile"]),
    Seed {
        kind: EntryType::Expense,
        name: "其他",
        synonyms: &[],
        is_default: true,
    },
    income(
        "工资",
        &[
            "薪水",
            "薪资",
            "月薪",
            "发工资",
            "salary",
            "wage",
            "wages",
            "paycheck",
            "payroll",
        ],
    ),
    income("奖金", &["年终奖", "提成", "bonus"]),
    income(
        "理财",
        &["利息", "分红", "基金", "股票", "interest", "dividend"],
    ),
    income("红包", &["收红包", "red packet"]),
    income("报销", &["reimbursement", "refund", "退款"]),
    Seed {
        kind: EntryType::Income,
        name: "其他",
        synonyms: &[],
        is_default: true,
    },
];

/// How a category was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchKind {
    /// The hint is the category's name.
    Name,
    /// The hint is one of its synonyms.
    Synonym,
    /// A name or synonym occurs inside the hint, or the hint inside a name.
    Substring,
    /// Nothing matched: the type's default category.
    Default,
}

impl MatchKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Name => "name",
            Self::Synonym => "synonym",
            Self::Substring => "substring",
            Self::Default => "default",
        }
    }
}

/// Whether `needle` occurs in `haystack` (both lowercase). ASCII words must
/// stand alone, so "bus" does not match "business"; CJK has no word breaks.
fn contains_word(haystack: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    if !needle.is_ascii() {
        return haystack.contains(needle);
    }
    let is_word = |c: char| c.is_ascii_alphanumeric();
    haystack.match_indices(needle).any(|(start, _)| {
        let before = haystack[..start].chars().next_back();
        let after = haystack[start + needle.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// Resolves `hints` (tried in order: the model's category name, then the
/// note) to a category of type `kind`. `None` only when `categories` has no
/// category of that type at all.
pub fn resolve<'a>(
    categories: &'a [Category],
    kind: EntryType,
    hints: &[Option<&str>],
) -> Option<(&'a Category, MatchKind)> {
    let of_kind: Vec<&Category> = categories.iter().filter(|c| c.kind == kind).collect();
    for hint in hints.iter().flatten() {
        let hint: String = hint
            .trim()
            .chars()
            .take(MAX_CATEGORY_HINT_CHARS)
            .collect::<String>()
            .to_lowercase();
        if hint.is_empty() {
            continue;
        }
        if let Some(found) = resolve_hint(&of_kind, &hint) {
            return Some(found);
        }
    }
    of_kind
        .iter()
        .find(|c| c.is_default)
        .or_else(|| of_kind.last())
        .map(|c| (*c, MatchKind::Default))
}

fn resolve_hint<'a>(of_kind: &[&'a Category], hint: &str) -> Option<(&'a Category, MatchKind)> {
    if let Some(c) = of_kind.iter().find(|c| c.name.to_lowercase() == hint) {
        return Some((c, MatchKind::Name));
    }
    if let Some(c) = of_kind
        .iter()
        .find(|c| c.synonyms.iter().any(|s| s.to_lowercase() == hint))
    {
        return Some((c, MatchKind::Synonym));
    }
    let mut best: Option<(&Category, usize)> = None;
    for category in of_kind.iter().filter(|c| !c.is_default) {
        let name = category.name.to_lowercase();
        let needles =
            std::iter::once(name.clone()).chain(category.synonyms.iter().map(|s| s.to_lowercase()));
        for needle in needles {
            if contains_word(hint, &needle)
                && best.is_none_or(|(_, len)| needle.chars().count() > len)
            {
                best = Some((category, needle.chars().count()));
            }
        }
        if best.is_none() && name.contains(hint) {
            best = Some((category, hint.chars().count()));
        }
    }
    best.map(|(c, _)| (c, MatchKind::Substring))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded() -> Vec<Category> {
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

    fn name_of(kind: EntryType, hints: &[Option<&str>]) -> (String, MatchKind) {
        let categories = seeded();
        let (category, how) = resolve(&categories, kind, hints).expect("a category");
        (category.name.clone(), how)
    }

    #[test]
    fn exact_then_synonym_then_substring_then_default() {
        use EntryType::{Expense, Income};
        assert_eq!(
            name_of(Expense, &[Some("交通")]),
            ("交通".into(), MatchKind::Name)
        );
        assert_eq!(
            name_of(Expense, &[Some("午饭")]),
            ("餐饮".into(), MatchKind::Synonym)
        );
        assert_eq!(
            name_of(Expense, &[Some("Taxi")]),
            ("交通".into(), MatchKind::Synonym)
        );
        assert_eq!(
            name_of(Expense, &[Some("中午吃粉")]),
            ("餐饮".into(), MatchKind::Substring)
        );
        assert_eq!(
            name_of(Expense, &[Some("坐地铁去公司")]),
            ("交通".into(), MatchKind::Substring)
        );
        assert_eq!(
            name_of(Expense, &[Some("餐")]),
            ("餐饮".into(), MatchKind::Substring)
        );
        assert_eq!(
            name_of(Expense, &[Some("买了个锤子")]),
            ("其他".into(), MatchKind::Default)
        );
        assert_eq!(
            name_of(Expense, &[None]),
            ("其他".into(), MatchKind::Default)
        );
        assert_eq!(
            name_of(Income, &[Some("发工资")]),
            ("工资".into(), MatchKind::Synonym)
        );
        assert_eq!(
            name_of(Income, &[Some("午饭")]),
            ("其他".into(), MatchKind::Default)
        );
    }

    #[test]
    fn later_hints_are_tried_and_ascii_needs_word_boundaries() {
        use EntryType::Expense;
        assert_eq!(
            name_of(Expense, &[Some("随便"), Some("打车回家")]).0,
            "交通"
        );
        assert_eq!(name_of(Expense, &[Some("business trip")]).0, "其他");
        assert_eq!(name_of(Expense, &[Some("bus ticket")]).0, "交通");
        // The longest needle wins: 买药 (医疗) over 药 and over nothing else.
        assert_eq!(name_of(Expense, &[Some("去药店买药")]).0, "医疗");
    }

    #[test]
    fn every_type_has_one_default_and_names_are_unique_per_type() {
        for kind in [EntryType::Income, EntryType::Expense] {
            let of_kind: Vec<_> = DEFAULT_CATEGORIES
                .iter()
                .filter(|s| s.kind == kind)
                .collect();
            assert_eq!(of_kind.iter().filter(|s| s.is_default).count(), 1);
            let names: std::collections::HashSet<_> = of_kind.iter().map(|s| s.name).collect();
            assert_eq!(names.len(), of_kind.len());
        }
    }

    /// Every default category has an English name, and the page's table
    /// (`CATEGORIES_EN` in the app's i18n.js) says the same for each: a
    /// reply and the page around it never name one category two ways.
    #[test]
    fn english_names_cover_the_defaults_and_match_the_page() {
        let page = include_str!("../../agentgate-app/assets/i18n.js");
        let table = page
            .split_once("const CATEGORIES_EN = {")
            .and_then(|(_, rest)| rest.split_once("};"))
            .map(|(table, _)| table)
            .expect("i18n.js has CATEGORIES_EN");
        let mut on_page = std::collections::BTreeMap::new();
        for line in table.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (name, english) = line
                .trim_end_matches(',')
                .split_once(": ")
                .unwrap_or_else(|| panic!("a CATEGORIES_EN line: {line}"));
            on_page.insert(name.trim_matches('"'), english.trim_matches('"'));
        }
        for seed in DEFAULT_CATEGORIES {
            let english = english_name(seed.name);
            assert_ne!(english, seed.name, "{} has no English name", seed.name);
            assert_eq!(
                on_page.get(seed.name),
                Some(&english),
                "the page names {} otherwise",
                seed.name
            );
        }
        assert_eq!(
            english_name("my own"),
            "my own",
            "a user's category keeps its name"
        );
    }
}
