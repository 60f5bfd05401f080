// Must NOT compile: a training step whose predicted peak (known at compile time) exceeds the
// budget stops the build with a sentence and both numbers (tests/CMakeLists.txt matches it).
#include "membound/model/planner.hpp"

namespace mb = membound;
using P = mb::fp32_precision;
using net = mb::model<mb::embedding<P>, mb::block<mb::attention<P>>, mb::lm_head<P>>;
constexpr mb::model_config cfg{.vocab = 64, .width = 64, .heads = 4};
using plan = mb::static_plan<net, cfg, mb::batch_shape{2, 64}, mb::schedules::none, 1000>;
static_assert(plan::fits);

int main() {}
