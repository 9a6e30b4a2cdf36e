//! The offline model's reading of a chat message: which entries it holds
//! (amount, words, date, income or expense). Pure and deterministic.
//!
//! It understands "35", "35.5元", "¥18", "18块", "18块5", "3千", "1.5万",
//! Chinese numerals with or without a currency word ("三十五块", "十块五",
//! "打车花了二十五", "一百二", "两千"), relative and explicit dates (今天/昨天/前天/today/yesterday/2024-05-01/
//! 5月1日), income words (工资/salary/收入…), and several entries in one
//! message ("午饭 35，打车 18"). It is a stand-in for a language model, not a
//! grammar: anything it misreads, the tools' validation still guards.

use crate::date::RELATIVE_DATE_WORDS;
use crate::records::EntryType;

/// One entry read from a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedEntry {
    /// Income or expense.
    pub kind: EntryType,
    /// The amount as decimal text, as written ("35", "35.5", "0", "-5").
    pub amount: String,
    /// The words describing it ("中午吃粉"), possibly empty.
    pub hint: String,
    /// The date words that apply to it, as written ("昨天", "2024-05-01").
    pub date: Option<String>,
}

/// Words that make an entry income rather than expense.
const INCOME_WORDS: &[&str] = &[
    "工资",
    "薪水",
    "薪资",
    "收入",
    "收到",
    "到账",
    "进账",
    "奖金",
    "年终奖",
    "红包",
    "利息",
    "分红",
    "报销",
    "退款",
    "赚了",
    "salary",
    "income",
    "bonus",
    "received",
    "earned",
    "refund",
    "paycheck",
    "dividend",
    "wage",
];

/// Filler words dropped from an entry's description, longest first.
const FILLERS: &[&str] = &[
    "一共花了",
    "总共花了",
    "花了",
    "花费",
    "花掉",
    "用了",
    "付了",
    "支付了",
    "支付",
    "消费了",
    "消费",
    "一共",
    "总共",
    "大概",
    "大约",
];

/// English filler words dropped when they stand alone.
const ENGLISH_FILLERS: &[&str] = &[
    "spent", "paid", "pay", "cost", "costs", "for", "on", "the", "a", "an", "my", "i", "yuan",
    "rmb", "dollars", "bucks", "was", "is", "got",
];

/// Characters right after a number that make it a count or a time, not money.
const UNIT_CHARS: &[char] = &[
    '个', '次', '点', '斤', '岁', '人', '杯', '份', '件', '天', '号', '月', '日', '年', '瓶', '张',
    '本', '碗', '楼', '层', '分', '秒', '周', '%', ':', '：', '位', '只', '双', '台', '公', '小',
];

/// Separators between entries.
const SEPARATORS: &[char] = &['，', ',', '；', ';', '。', '\n', '、', '！', '!', '？', '?'];

const CHINESE_DIGITS: &str = "零〇一二两三四五六七八九十百千万";

/// What a Chinese numeral may start with: a digit or 十 ("十五"), never a
/// bare unit ("万一" is "in case", not 10001).
const CHINESE_NUMBER_STARTS: &str = "一二两三四五六七八九十";

/// Words right before a bare Chinese numeral that make it money even
/// without a unit ("花了五"), longest first.
const SPENDING_WORDS: &[&str] = &["花了", "用了", "付了", "花", "付"];

/// Reads the entries of a message, in order.
pub fn parse_message(text: &str) -> Vec<ParsedEntry> {
    let text = normalize(text);
    let segments: Vec<Segment> = text
        .split(SEPARATORS)
        .map(read_segment)
        .filter(|s| !s.is_blank())
        .collect();
    let message_date = segments.iter().find_map(|s| s.date.clone());
    let mut entries = Vec::new();
    let mut carried_hint = String::new();
    for segment in segments {
        if segment.amounts.is_empty() {
            // "买了衣服，花了 300": the words come before the amount's segment.
            carried_hint = clean(&segment.rest_text());
            continue;
        }
        let single = segment.amounts.len() == 1;
        for (index, amount) in segment.amounts.iter().enumerate() {
            let raw = segment.description(index);
            let mut hint = clean(&raw);
            if hint.is_empty() {
                hint = std::mem::take(&mut carried_hint);
            }
            let income_text = if single { segment.text.clone() } else { raw };
            entries.push(ParsedEntry {
                kind: if is_income(&income_text) || is_income(&hint) {
                    EntryType::Income
                } else {
                    EntryType::Expense
                },
                amount: amount.value.clone(),
                hint,
                date: segment.date.clone().or_else(|| message_date.clone()),
            });
        }
        carried_hint.clear();
    }
    entries
}

fn is_income(text: &str) -> bool {
    let lower = text.to_lowercase();
    INCOME_WORDS.iter().any(|w| lower.contains(w))
}

/// Full-width digits and symbols to ASCII; thousands separators dropped.
fn normalize(text: &str) -> String {
    let mapped: Vec<char> = text
        .chars()
        .map(|c| match c {
            '０'..='９' => char::from_u32(c as u32 - '０' as u32 + '0' as u32).unwrap_or(c),
            '．' => '.',
            '￥' => '¥',
            '－' => '-',
            '\u{3000}' => ' ',
            _ => c,
        })
        .collect();
    let mut out = String::with_capacity(text.len());
    for (i, c) in mapped.iter().enumerate() {
        let thousands = *c == ','
            && i > 0
            && mapped[i - 1].is_ascii_digit()
            && mapped
                .get(i + 1..i + 4)
                .is_some_and(|d| d.iter().all(char::is_ascii_digit))
            && !mapped.get(i + 4).is_some_and(char::is_ascii_digit);
        if !thousands {
            out.push(*c);
        }
    }
    out
}

/// An amount found in a segment: its value and where it sits (char indices).
#[derive(Debug)]
struct Amount {
    value: String,
    start: usize,
    end: usize,
}

/// One separator-delimited piece of a message with dates blanked out.
#[derive(Debug)]
struct Segment {
    text: String,
    chars: Vec<char>,
    date: Option<String>,
    amounts: Vec<Amount>,
}

impl Segment {
    fn is_blank(&self) -> bool {
        self.chars.iter().all(|c| c.is_whitespace()) && self.date.is_none()
    }

    fn slice(&self, from: usize, to: usize) -> String {
        self.chars[from.min(to)..to].iter().collect()
    }

    fn rest_text(&self) -> String {
        self.slice(0, self.chars.len())
    }

    /// The words of the `index`th amount: between the previous amount and
    /// this one, or (when that is empty) after this one up to the next.
    fn description(&self, index: usize) -> String {
        let start = if index == 0 {
            0
        } else {
            self.amounts[index - 1].end
        };
        let before = self.slice(start, self.amounts[index].start);
        if !clean(&before).is_empty() {
            return before;
        }
        let end = self
            .amounts
            .get(index + 1)
            .map_or(self.chars.len(), |next| next.start);
        self.slice(self.amounts[index].end, end)
    }
}

fn read_segment(text: &str) -> Segment {
    let mut chars: Vec<char> = text.chars().collect();
    let date = take_date(&mut chars);
    let amounts = find_amounts(&chars);
    Segment {
        text: text.to_owned(),
        chars,
        date,
        amounts,
    }
}

/// Finds the first date in `chars`, blanks every date out, returns the first.
fn take_date(chars: &mut [char]) -> Option<String> {
    let mut first: Option<(usize, String)> = None;
    let mut note = |start: usize, text: String| {
        if first.as_ref().is_none_or(|(s, _)| start < *s) {
            first = Some((start, text));
        }
    };
    let mut i = 0;
    while i < chars.len() {
        if let Some(len) = iso_date_len(&chars[i..]).or_else(|| month_day_len(&chars[i..])) {
            note(i, chars[i..i + len].iter().collect());
            chars[i..i + len].fill(' ');
            i += len;
        } else {
            i += 1;
        }
    }
    let lower: Vec<char> = chars.iter().map(|c| c.to_ascii_lowercase()).collect();
    for (word, _) in RELATIVE_DATE_WORDS {
        let word: Vec<char> = word.chars().collect();
        let mut i = 0;
        while i + word.len() <= lower.len() {
            if lower[i..i + word.len()] == word[..] && chars[i] != ' ' {
                note(i, word.iter().collect());
                chars[i..i + word.len()].fill(' ');
                i += word.len();
            } else {
                i += 1;
            }
        }
    }
    first.map(|(_, text)| text)
}

fn digits_len(chars: &[char], max: usize) -> usize {
    chars
        .iter()
        .take(max)
        .take_while(|c| c.is_ascii_digit())
        .count()
}

/// `dddd-d{1,2}-d{1,2}` with `-`, `/` or `.`, valid or not (validation
/// tells the model about 2024-13-45).
fn iso_date_len(chars: &[char]) -> Option<usize> {
    if digits_len(chars, 5) != 4 {
        return None;
    }
    let separator = *chars.get(4)?;
    if !matches!(separator, '-' | '/' | '.') {
        return None;
    }
    let month = digits_len(&chars[5..], 3);
    if !(1..=2).contains(&month) || chars.get(5 + month) != Some(&separator) {
        return None;
    }
    let day = digits_len(&chars[6 + month..], 3);
    (1..=2).contains(&day).then_some(6 + month + day)
}

/// `d{1,2}月d{1,2}[日号]`.
fn month_day_len(chars: &[char]) -> Option<usize> {
    let month = digits_len(chars, 3);
    if !(1..=2).contains(&month) || chars.get(month) != Some(&'月') {
        return None;
    }
    let day = digits_len(&chars[month + 1..], 3);
    let end = month + 1 + day;
    ((1..=2).contains(&day) && matches!(chars.get(end), Some('日' | '号'))).then_some(end + 1)
}

fn find_amounts(chars: &[char]) -> Vec<Amount> {
    let mut amounts = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if let Some((amount, next)) = arabic_amount(chars, i).or_else(|| chinese_amount(chars, i)) {
            amounts.push(amount);
            i = next;
        } else {
            i += 1;
        }
    }
    amounts
}

/// Length of a currency word at `chars[i..]` (块钱, 块, 元, rmb, yuan, …).
fn currency_suffix_len(chars: &[char], i: usize) -> usize {
    const SUFFIXES: &[&str] = &["块钱", "块", "元", "刀", "rmb", "yuan", "dollars", "bucks"];
    for suffix in SUFFIXES {
        let word: Vec<char> = suffix.chars().collect();
        let matches = chars.get(i..i + word.len()).is_some_and(|s| {
            s.iter()
                .map(char::to_ascii_lowercase)
                .eq(word.iter().copied())
        });
        if matches {
            return word.len();
        }
    }
    0
}

/// An amount written in digits starting at `i`: `[¥$]? -? digits (.digits)?
/// [currency]? (块 digit → jiao)`. Counts, times and model numbers are skipped.
fn arabic_amount(chars: &[char], i: usize) -> Option<(Amount, usize)> {
    let start = i;
    let mut j = i;
    let prefixed = matches!(chars[j], '¥' | '$');
    if prefixed {
        j += 1;
        while chars.get(j) == Some(&' ') {
            j += 1;
        }
    }
    let negative = chars.get(j) == Some(&'-');
    if negative {
        j += 1;
    }
    let whole = digits_len(&chars[j.min(chars.len())..], usize::MAX);
    if whole == 0 {
        return None;
    }
    // A digit glued to a letter or a time ("iPhone15", "12:30") is no amount.
    if let Some(before) = i.checked_sub(1).map(|b| chars[b]) {
        if before.is_ascii_alphanumeric() || before == ':' || before == '.' {
            return None;
        }
    }
    let mut value: String = chars[j..j + whole].iter().collect();
    j += whole;
    if chars.get(j) == Some(&'.') && chars.get(j + 1).is_some_and(char::is_ascii_digit) {
        let fraction = digits_len(&chars[j + 1..], usize::MAX);
        value.push('.');
        value.extend(&chars[j + 1..j + 1 + fraction]);
        j += 1 + fraction;
    }
    if chars.get(j).is_some_and(|c| UNIT_CHARS.contains(c)) {
        return None;
    }
    // "3千" is 3000, "1.5万" is 15000.
    let zeros = match chars.get(j) {
        Some('百') => 2,
        Some('千') => 3,
        Some('万') => 4,
        _ => 0,
    };
    if zeros > 0 {
        value = shift_decimal(&value, zeros)?;
        j += 1;
    }
    let mut k = j;
    while chars.get(k) == Some(&' ') {
        k += 1;
    }
    let suffix = currency_suffix_len(chars, k);
    if suffix > 0 {
        j = k + suffix;
        // "18块5": five jiao.
        if chars[k] == '块'
            && suffix == 1
            && digits_len(&chars[j..], 2) == 1
            && !value.contains('.')
        {
            value.push('.');
            value.push(chars[j]);
            j += 1;
        }
    }
    if negative {
        value.insert(0, '-');
    }
    Some((
        Amount {
            value,
            start,
            end: j,
        },
        j,
    ))
}

/// `value` times 10^`zeros`, as decimal text: ("1.5", 4) → "15000".
fn shift_decimal(value: &str, zeros: usize) -> Option<String> {
    let (whole, fraction) = value.split_once('.').unwrap_or((value, ""));
    if fraction.len() > zeros {
        return None;
    }
    let mut digits = format!("{whole}{fraction}");
    digits.extend(std::iter::repeat_n('0', zeros - fraction.len()));
    let trimmed = digits.trim_start_matches('0');
    Some(if trimmed.is_empty() { "0" } else { trimmed }.to_owned())
}

/// An amount in Chinese numerals: with a currency word (三十五块, 十块五)
/// anywhere, or without one when it ends its phrase and either has a unit
/// in it (二十五, 一百二, 两千) or follows a spending word (花了五). A
/// numeral glued to more words (十一假期, 两个人, 一共) is not money.
fn chinese_amount(chars: &[char], i: usize) -> Option<(Amount, usize)> {
    if !CHINESE_NUMBER_STARTS.contains(chars[i]) || chars.get(i.wrapping_sub(1)) == Some(&'第') {
        return None;
    }
    let len = chars[i..]
        .iter()
        .take_while(|c| CHINESE_DIGITS.contains(**c))
        .count();
    let numeral = &chars[i..i + len];
    let value = chinese_number(numeral)?;
    let suffix = currency_suffix_len(chars, i + len);
    if suffix == 0 {
        let ends_phrase = chars.get(i + len).is_none_or(|c| c.is_whitespace());
        let has_unit = numeral.iter().any(|c| "十百千万".contains(*c));
        if !ends_phrase || !(has_unit || follows_spending_word(chars, i)) {
            return None;
        }
        let end = i + len;
        return Some((
            Amount {
                value: value.to_string(),
                start: i,
                end,
            },
            end,
        ));
    }
    let mut end = i + len + suffix;
    let mut text = value.to_string();
    // "十块五" (and "十块五毛"): five jiao.
    if chars[i + len] == '块' && suffix == 1 {
        let jiao = chars
            .get(end)
            .and_then(|c| "一二两三四五六七八九".find(*c).map(|_| *c));
        let glued = chars
            .get(end + 1)
            .is_some_and(|c| CHINESE_DIGITS.contains(*c));
        if let (Some(jiao), false) = (jiao, glued) {
            let digit = chinese_number(&[jiao])?;
            text = format!("{value}.{digit}");
            end += 1;
            if matches!(chars.get(end), Some('毛' | '角')) {
                end += 1;
            }
        }
    }
    Some((
        Amount {
            value: text,
            start: i,
            end,
        },
        end,
    ))
}

/// Whether a spending word ends right before `chars[i]` (spaces between
/// allowed).
fn follows_spending_word(chars: &[char], i: usize) -> bool {
    let before: String = chars[..i].iter().collect();
    let before = before.trim_end();
    SPENDING_WORDS.iter().any(|word| before.ends_with(word))
}

/// 三十五 → 35, 十八 → 18, 一百二 → 120, 两千 → 2000, 一万五 → 15000.
fn chinese_number(chars: &[char]) -> Option<u64> {
    let mut total: u64 = 0;
    let mut section: u64 = 0;
    let mut number: u64 = 0;
    let mut last_unit: u64 = 1;
    // After a 零 the digit is in the ones place: 两千零五 is 2005, not 2500.
    let mut zero = false;
    // Two digits in a row ("二五") are no number, except after 零.
    let mut previous_digit: Option<char> = None;
    for c in chars {
        let digit = "零一二三四五六七八九".chars().position(|d| d == *c);
        let is_digit = digit.is_some() || matches!(c, '〇' | '两');
        if is_digit && previous_digit.is_some_and(|p| !matches!(p, '零' | '〇')) {
            return None;
        }
        previous_digit = is_digit.then_some(*c);
        if matches!(c, '零' | '〇') {
            zero = true;
        }
        match (c, digit) {
            ('〇', _) => number = 0,
            ('两', _) => number = 2,
            (_, Some(d)) => number = u64::try_from(d).ok()?,
            ('十' | '百' | '千', _) => {
                let unit = match c {
                    '十' => 10,
                    '百' => 100,
                    _ => 1000,
                };
                if number == 0 && unit == 10 {
                    number = 1;
                }
                section += number * unit;
                number = 0;
                last_unit = unit;
            }
            ('万', _) => {
                total += (section + number) * 10_000;
                section = 0;
                number = 0;
                last_unit = 10_000;
            }
            _ => return None,
        }
    }
    // Colloquial "一百二" is 120 and "一万五" is 15000: a lone trailing digit
    // counts in the unit below the last one.
    if number > 0 && last_unit >= 100 && !zero {
        number *= last_unit / 10;
    }
    Some(total + section + number)
}

/// An entry's words without fillers, punctuation and extra spaces.
fn clean(text: &str) -> String {
    let mut text = text.to_owned();
    for filler in FILLERS {
        text = text.replace(filler, " ");
    }
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || (c.is_ascii_punctuation() && c != '\''))
        .filter(|w| !w.is_empty())
        .filter(|w| !ENGLISH_FILLERS.contains(&w.to_lowercase().as_str()))
        .collect();
    words
        .join(" ")
        .trim_matches(|c: char| "，。：:的了¥$".contains(c))
        .trim()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<(EntryType, String, String, Option<String>)> {
        parse_message(text)
            .into_iter()
            .map(|e| (e.kind, e.amount, e.hint, e.date))
            .collect()
    }

    fn one(
        kind: EntryType,
        amount: &str,
        hint: &str,
        date: Option<&str>,
    ) -> (EntryType, String, String, Option<String>) {
        (kind, amount.into(), hint.into(), date.map(Into::into))
    }

    use EntryType::{Expense, Income};

    #[test]
    fn the_seed_sentence_is_one_expense() {
        assert_eq!(
            read("中午吃粉花了 35"),
            vec![one(Expense, "35", "中午吃粉", None)]
        );
    }

    #[test]
    fn several_entries_in_one_message() {
        assert_eq!(
            read("午饭 35，打车 18"),
            vec![
                one(Expense, "35", "午饭", None),
                one(Expense, "18", "打车", None)
            ]
        );
        assert_eq!(
            read("打车 18 午饭 35.5元"),
            vec![
                one(Expense, "18", "打车", None),
                one(Expense, "35.5", "午饭", None)
            ]
        );
    }

    #[test]
    fn currencies_and_chinese_numerals() {
        assert_eq!(read("¥18 taxi"), vec![one(Expense, "18", "taxi", None)]);
        assert_eq!(read("奶茶18块5"), vec![one(Expense, "18.5", "奶茶", None)]);
        assert_eq!(read("早餐三十五块"), vec![one(Expense, "35", "早餐", None)]);
        assert_eq!(
            read("房租 1,200 元"),
            vec![one(Expense, "1200", "房租", None)]
        );
        assert_eq!(
            read("买了3杯咖啡 30"),
            vec![one(Expense, "30", "买了3杯咖啡", None)]
        );
        assert_eq!(
            chinese_number(&"一百二".chars().collect::<Vec<_>>()),
            Some(120)
        );
        assert_eq!(
            chinese_number(&"两千零五".chars().collect::<Vec<_>>()),
            Some(2005)
        );
        assert_eq!(
            chinese_number(&"一万五".chars().collect::<Vec<_>>()),
            Some(15_000)
        );
    }

    #[test]
    fn chinese_numerals_without_a_currency_word() {
        assert_eq!(
            read("打车花了二十五"),
            vec![one(Expense, "25", "打车", None)]
        );
        assert_eq!(read("午饭三十五"), vec![one(Expense, "35", "午饭", None)]);
        assert_eq!(read("聚餐 一百二"), vec![one(Expense, "120", "聚餐", None)]);
        assert_eq!(read("手机 两千"), vec![one(Expense, "2000", "手机", None)]);
        assert_eq!(read("咖啡花了五"), vec![one(Expense, "5", "咖啡", None)]);
        assert_eq!(
            read("昨天打车花了三十五，午饭二十"),
            vec![
                one(Expense, "35", "打车", Some("昨天")),
                one(Expense, "20", "午饭", Some("昨天"))
            ]
        );
    }

    #[test]
    fn multipliers_and_jiao() {
        assert_eq!(read("电脑 3千"), vec![one(Expense, "3000", "电脑", None)]);
        assert_eq!(read("奖金 1.5万"), vec![one(Income, "15000", "奖金", None)]);
        assert_eq!(read("房租 2千元"), vec![one(Expense, "2000", "房租", None)]);
        assert_eq!(read("奶茶十块五"), vec![one(Expense, "10.5", "奶茶", None)]);
        assert_eq!(
            read("早饭八块五毛"),
            vec![one(Expense, "8.5", "早饭", None)]
        );
        assert_eq!(shift_decimal("1.25", 1), None);
        assert_eq!(shift_decimal("0.5", 3).as_deref(), Some("500"));
    }

    #[test]
    fn chinese_numerals_in_words_are_not_money() {
        // A numeral glued to more words, a bare unit, an ordinal or a digit
        // run: none is an amount, so only the real one is read.
        assert_eq!(
            read("十一假期吃饭 50"),
            vec![one(Expense, "50", "十一假期吃饭", None)]
        );
        assert_eq!(read("两个人 80"), vec![one(Expense, "80", "两个人", None)]);
        assert_eq!(read("万一 30"), vec![one(Expense, "30", "万一", None)]);
        assert_eq!(read("第二杯 12"), vec![one(Expense, "12", "第二杯", None)]);
        assert!(read("一起吃饭").is_empty());
        assert!(read("吃了一").is_empty());
        assert_eq!(chinese_number(&"二五".chars().collect::<Vec<_>>()), None);
    }

    #[test]
    fn dates_apply_to_their_entry_or_the_whole_message() {
        assert_eq!(
            read("taxi 18 yesterday"),
            vec![one(Expense, "18", "taxi", Some("yesterday"))]
        );
        assert_eq!(
            read("昨天午饭 35，打车 18"),
            vec![
                one(Expense, "35", "午饭", Some("昨天")),
                one(Expense, "18", "打车", Some("昨天"))
            ]
        );
        assert_eq!(
            read("午饭 35 2024-13-45"),
            vec![one(Expense, "35", "午饭", Some("2024-13-45"))]
        );
        assert_eq!(
            read("5月1日 电影 60"),
            vec![one(Expense, "60", "电影", Some("5月1日"))]
        );
        assert_eq!(
            read("12:30 吃饭 20"),
            vec![one(Expense, "20", "12 30 吃饭", None)]
        );
    }

    #[test]
    fn income_words_make_income() {
        assert_eq!(
            read("发工资 8000"),
            vec![one(Income, "8000", "发工资", None)]
        );
        assert_eq!(
            read("salary 12000 today"),
            vec![one(Income, "12000", "salary", Some("today"))]
        );
    }

    #[test]
    fn words_before_the_amount_carry_and_bad_amounts_pass_through() {
        assert_eq!(
            read("买了衣服，花了 300"),
            vec![one(Expense, "300", "买了衣服", None)]
        );
        assert_eq!(read("午饭 0"), vec![one(Expense, "0", "午饭", None)]);
        assert_eq!(read("退款 -5"), vec![one(Income, "-5", "退款", None)]);
        assert!(read("你好").is_empty());
        assert!(read("iPhone15").is_empty());
    }
}
