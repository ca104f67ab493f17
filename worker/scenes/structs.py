"""The constants and data structs of a synthetic scene (times, cameras, fact categories,
control limits, task prompts; SceneFacts, Plan, SceneText, TaskDefaults, Scene)."""

from __future__ import annotations

import msgspec

DT = 0.1
N_HISTORY = 16
N_FUTURE = 64
HISTORY_TIMES_S: tuple[float, ...] = tuple(round(-1.5 + DT * i, 1) for i in range(N_HISTORY))
FUTURE_TIMES_S: tuple[float, ...] = tuple(round(DT * (i + 1), 1) for i in range(N_FUTURE))
FRAME_OFFSETS_S: tuple[float, ...] = (-0.3, -0.2, -0.1, 0.0)
# (width, height) synthetic scenes are rendered at unless a caller says otherwise: what the producer
# tools, `make demo`, qualify and calibration send (the shipped demo checkpoint's training scenes;
# its quality.json records the size, `worker.demo.build.scene_image_size`)
DEFAULT_IMAGE_SIZE: tuple[int, int] = (128, 128)

CAMERA_NAMES: dict[int, str] = {
    0: "camera_cross_left_120fov",
    1: "camera_front_wide_120fov",
    2: "camera_cross_right_120fov",
    3: "camera_rear_left_70fov",
    4: "camera_rear_tele_30fov",
    5: "camera_rear_right_70fov",
    6: "camera_front_tele_30fov",
}
TRAJ_CAMERA_IDS: tuple[int, ...] = (0, 1, 2, 3, 5, 6)
VQA_CAMERA_IDS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)

LIGHT_STATES: tuple[str, ...] = ("none", "green", "yellow", "red")
LEAD_RELATIONS: tuple[str, ...] = ("none", "stopped", "slower", "similar", "faster")
VEHICLE_COLORS: tuple[str, ...] = ("white", "red", "blue", "black", "silver")
WEATHERS: tuple[str, ...] = ("clear", "cloudy", "rain")
TIMES_OF_DAY: tuple[str, ...] = ("day", "dusk")

LANE_WIDTH = 3.5
ROAD_HALF_WIDTH = 1.5 * LANE_WIDTH
EGO_FRONT = 2.0  # ego origin (rear axle) -> front bumper, m
LEAD_LENGTH = 4.5
STOP_LINE_MARGIN = 3.0  # ego origin stops this far before a stop line
CROSSWALK_MARGIN = 5.0  # ego origin stops this far before the crosswalk centre
CROSSWALK_AFTER_STOP_LINE = 3.0  # crosswalk centre behind the stop line when both exist
MIN_LEAD_CLEARANCE = 3.0  # lead rear - ego origin must stay above this (>= 1 m bumper gap)

# Longitudinal control (IDM for free road and lead vehicle; kinematic stop targets).
V_MAX = 17.0  # desired speed on a straight road, m/s
LAT_ACCEL_COMFORT = 2.5  # sets the desired speed on curves, m/s^2
IDM_A = 1.5
IDM_B = 2.0
IDM_T = 1.2
IDM_S0 = 5.0  # ego origin -> lead rear at standstill (3 m bumper gap)
ACCEL_MIN = -6.0
ACCEL_MAX = 3.0
JERK_MAX = 8.0  # m/s^3
STOP_ONSET = 0.4  # start braking for a stop target once v^2/(2d) exceeds this, m/s^2
YELLOW_STOP_DECEL = 2.5  # stop at a yellow light when the needed decel is at most this
CURVATURE_MAX = 0.3

GROUNDING_QUESTION = "Find the lead vehicle directly ahead and return its bounding box in JSON."
VQA_QUESTIONS: tuple[str, ...] = (
    "What color is the traffic light ahead?",
    "Is there a vehicle directly ahead of the ego vehicle?",
    "Is a pedestrian crossing the road ahead?",
    "Should the ego vehicle stop?",
)


class OtherVehicle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cosmetic traffic (side and rear cameras); does not affect the planner."""

    lane: str  # "left" | "right" | "ego" (ego lane, behind the ego vehicle)
    offset: float  # along-road position of its rear at t0, m (negative: behind the ego origin)
    speed: float  # m/s, constant
    color: str


class SceneFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The sampled ground truth of one scene. Distances are along-road, from the ego origin."""

    road_curvature: float  # 1/m, left positive; 0.0 is a straight road
    ego_speed: float  # m/s at t0
    ego_accel: float  # m/s^2, constant over the history (speed clamped at 0)
    desired_speed: float  # m/s, the planner's cruise speed (a function of the curvature)
    lead_present: bool
    lead_gap: float  # ego origin -> lead rear bumper, m (0 when absent)
    lead_speed: float  # m/s (0 when absent)
    lead_color: str  # one of VEHICLE_COLORS, "" when absent
    traffic_light: str  # "none" | "green" | "yellow" | "red"
    stop_line_distance: float  # m (0 when no light)
    pedestrian_crossing: bool
    pedestrian_side: str  # "left" | "right" (side the pedestrian comes from) | "none"
    pedestrian_distance: float  # crosswalk centre, m (0 when none)
    blocked_lane: bool
    blocked_lane_kind: str  # "none" | "adjacent" | "ego"
    # adjacent: side of the blocked adjacent lane; ego: side the ego changes to; else "none"
    blocked_lane_side: str
    blocked_distance: float  # barrier, m (0 when none)
    weather: str  # cosmetic
    time_of_day: str  # cosmetic
    other_vehicles: list[OtherVehicle] = []

    @property
    def lead_relation(self) -> str:
        """none | stopped | slower | similar | faster (lead speed versus ego speed)."""
        if not self.lead_present:
            return "none"
        if self.lead_speed < 0.5:
            return "stopped"
        dv = self.lead_speed - self.ego_speed
        if dv < -1.0:
            return "slower"
        if dv > 1.0:
            return "faster"
        return "similar"


class Plan(msgspec.Struct, frozen=True):
    """Planner output. Index 0 of the 65-long lists is t0; index i is t0 + 0.1 i."""

    speed: list[float]  # 65
    s: list[float]  # 65, along-road progress of the ego origin
    d: list[float]  # 65, lateral offset from the ego lane centre (left +)
    accel: list[float]  # 64, per step
    curvature: list[float]  # 64, per step
    xyz: list[list[float]]  # 64 x 3 future positions
    yaw: list[float]  # 64 future headings
    lead_s: list[float]  # 65, lead rear along-road (empty when no lead)
    stop_target: float  # along-road position the ego must not pass (inf when none)
    yellow_stop: bool  # the ego decided to stop at a yellow light
    lane_change: str  # "none" | "left" | "right"
    longitudinal: str
    lateral: str
    lane: str


class SceneText(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reasoning: str
    meta_action: str
    auto_labeling: str
    vqa_question: str
    vqa_answer: str
    grounding_question: str
    grounding_answer: str


class TaskDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-run choices for the text tasks.

    ``vqa_question``: index into VQA_QUESTIONS; None lets the seed pick one.
    ``grounding_question``: the grounding prompt (the answer format does not change).
    """

    vqa_question: int | None = None
    grounding_question: str = GROUNDING_QUESTION


class Scene(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    scene_id: str
    seed: int
    facts: SceneFacts
    image_format: str  # "png" | "jpeg"
    image_size: tuple[int, int]  # (width, height)
    frame_offsets_s: list[float]
    camera_ids: list[int]
    camera_order: list[str]
    images: list[bytes]  # len(camera_ids) * 4, camera-major, oldest frame first
    vqa_camera_ids: list[int]
    vqa_camera_order: list[str]
    vqa_images: list[bytes]
    ego_history_xyz: list[list[float]]  # 16 x 3
    ego_history_rot: list[list[list[float]]]  # 16 x 3 x 3
    ego_future_xyz: list[list[float]]  # 64 x 3
    ego_future_rot: list[list[list[float]]]  # 64 x 3 x 3
    text: SceneText
