// A minimal JSON writer for zoo_runner's reply lines and the runtime's build facts (flat: strings, numbers,
// bools, lists).
#pragma once

#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace zoo {

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

class JsonObject {
 public:
  JsonObject& raw(const std::string& key, const std::string& value) {
    fields_.push_back(json_string(key) + ": " + value);
    return *this;
  }
  JsonObject& str(const std::string& key, const std::string& value) { return raw(key, json_string(value)); }
  JsonObject& num(const std::string& key, double value) { return raw(key, json_number(value)); }
  JsonObject& boolean(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  std::string text() const {
    std::string out = "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      out += (i ? ", " : "") + fields_[i];
    }
    return out + "}";
  }

 private:
  std::vector<std::string> fields_;
};

template <typename T, typename F>
inline std::string json_list(const std::vector<T>& items, F to_json) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    out += (i ? ", " : "") + to_json(items[i]);
  }
  return out + "]";
}


inline void emit(const JsonObject& obj) {
  std::cout << obj.text() << std::endl;  // endl flushes: a caller on the other end of a pipe waits for it
}


inline std::string json_strings(const std::vector<std::string>& items) { return json_list(items, json_string); }

inline std::string json_bools(const std::vector<bool>& items) {
  return json_list(items, [](bool b) { return std::string(b ? "true" : "false"); });
}

}  // namespace zoo
