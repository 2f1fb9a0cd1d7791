"""`output_dir/report.png`: the run's metrics drawn at its end (drawing.py), finished or stopped by a signal
(`--report_png`, default on). See docs/report.md.
"""

from dataclasses import dataclass, field

from training.parts import Finished, Part


@dataclass
class ReportFlags:
    report_png: bool = field(
        default=True,
        metadata={"help": "Draw output_dir/report.png at the end of the run (about 1 s on the main process); false for "
                          "sweeps of many short runs (`python -m parts.report.drawing DIR` draws it later from metrics.jsonl)."},
    )


class Report(Part):
    name = "report"
    description = "report.png: loss, learning rate, throughput, gradient norm and every evaluation metric against the step"
    flags = ReportFlags
    files = ("docs/report.png",)

    def run_ended(self, finished: Finished) -> None:
        """Draw the report from metrics.jsonl (main process, the trackers flushed)."""
        if finished.args.parts.report.report_png:
            from parts.report.drawing import write_report

            write_report(finished.args.output_dir, finished.title)


PART = Report()
