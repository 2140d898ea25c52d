//! Text cut to the limits of the fields it goes into (condition messages, Events, admission
//! warnings), shared by the operator and the admission webhook.

/// Cuts `s` to at most `max` bytes (on a char boundary), marking the cut with `…`.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::truncate;

    #[test]
    fn short_text_is_kept_whole() {
        assert_eq!(truncate("héllo", 6), "héllo");
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        // "é" is two bytes: a cut after 2 bytes would fall inside it.
        assert_eq!(truncate("héllo", 2), "h…");
        assert_eq!(truncate("héllo", 3), "hé…");
    }
}
