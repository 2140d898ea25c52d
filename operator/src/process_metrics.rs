//! The `process_*` series every Prometheus client exports (and PKO, through client_golang):
//! CPU seconds, resident and virtual memory, open and maximum file descriptors, start time.
//! Read from `/proc/self` at each scrape; a file that cannot be read leaves its series out.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Clock ticks per second in `/proc` (USER_HZ: 100 on every Linux the images are built for).
const TICKS_PER_SECOND: f64 = 100.0;

/// The collector registered once per process.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// What `/proc/self/stat` says: CPU time (user + system) and start time, in clock ticks.
#[derive(Debug, PartialEq)]
pub struct Stat {
    pub cpu_ticks: u64,
    pub start_ticks: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // After the name: field 3 (state) is index 0, so field N is index N - 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        cpu_ticks: field(14)? + field(15)?,
        start_ticks: field(22)?,
    })
}

/// A `kB` value of `/proc/<pid>/status` (`VmRSS`, `VmSize`), in bytes.
pub fn status_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))?;
    let kib: u64 = line[key.len() + 1..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The soft limit of open files in `/proc/<pid>/limits` (`None` when unlimited).
pub fn max_open_files(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The boot time (`btime`, Unix seconds) in `/proc/stat`.
pub fn boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        #[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
        let as_f64 = |v: u64| v as f64;
        let stat = read("/proc/self/stat").and_then(|t| parse_stat(&t));
        if let Some(stat) = &stat {
            let cpu = ConstCounter::new(as_f64(stat.cpu_ticks) / TICKS_PER_SECOND);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                cpu.metric_type(),
            )?)?;
        }
        if let Some(status) = read("/proc/self/status") {
            if let Some(rss) = status_bytes(&status, "VmRSS") {
                let help = "Resident memory size in bytes.";
                gauge(
                    &mut encoder,
                    "process_resident_memory_bytes",
                    help,
                    as_f64(rss),
                )?;
            }
            if let Some(size) = status_bytes(&status, "VmSize") {
                let help = "Virtual memory size in bytes.";
                gauge(
                    &mut encoder,
                    "process_virtual_memory_bytes",
                    help,
                    as_f64(size),
                )?;
            }
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            let open = as_f64(fds.count() as u64);
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors.",
                open,
            )?;
        }
        if let Some(max) = read("/proc/self/limits").and_then(|t| max_open_files(&t)) {
            let help = "Maximum number of open file descriptors.";
            gauge(&mut encoder, "process_max_fds", help, as_f64(max))?;
        }
        if let (Some(stat), Some(boot)) = (&stat, read("/proc/stat").and_then(|t| boot_time(&t))) {
            let start = as_f64(boot) + as_f64(stat.start_ticks) / TICKS_PER_SECOND;
            let help = "Start time of the process since unix epoch in seconds.";
            gauge(&mut encoder, "process_start_time_seconds", help, start)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_read_as_the_kernel_writes_them() {
        // A name with a space and a parenthesis, as the kernel prints it.
        let stat = "4242 (pko (op) x) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 50 0 0 20 0 9 0 123456 1000 200 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                cpu_ticks: 300,
                start_ticks: 123_456
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        let status = "Name:\tpko\nVmSize:\t  2048 kB\nVmRSS:\t    512 kB\nVmRSSx:\t 1 kB\n";
        assert_eq!(status_bytes(status, "VmRSS"), Some(512 * 1024));
        assert_eq!(status_bytes(status, "VmSize"), Some(2048 * 1024));
        assert_eq!(status_bytes(status, "VmSwap"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        assert_eq!(max_open_files(limits), Some(1_048_576));
        assert_eq!(
            max_open_files("Max open files unlimited unlimited files"),
            None
        );
        assert_eq!(
            boot_time("cpu 1 2 3\nbtime 1700000000\nprocesses 5\n"),
            Some(1_700_000_000)
        );
    }

    #[test]
    fn this_process_is_measured() {
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(ProcessCollector));
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for series in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(text.contains(series), "{series} missing in:\n{text}");
        }
    }
}
